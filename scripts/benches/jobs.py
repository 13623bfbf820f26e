"""Batch jobs on the daemon (/v1/files and /v1/batches), measured with light callers:

    throughput      a job's generated tok/s (from its creation to `completed`, as a caller
                    polling it sees) beside cbatch-submit's on the same file and daemon
                    (greedy, ignore_eos), each run twice in turn, their ratio, and each
                    caller's CPU per line (which a shared machine disturbs less)
    TTFT            streamed /v1/completions from scripts/benches/loadgen.py (--ttft-callers closed-loop
                    callers), idle and while a job runs: p50 and p99, and loaded p99 / idle p99
    memory          the peak RSS of the daemon's processes (the sum over its process tree,
                    from /proc) while it runs --rss-lines lines (in jobs of at most 50,000
                    lines, OpenAI's limit per batch, all queued at once) above its idle RSS
    restart         kill -9 of the daemon mid-job, then the time from starting it again on
                    the same --state-dir to the first line the job newly finished

Each is a table of its own (the ratios and the job's state beside the probes are notes).

    .venv/bin/python scripts/make_tiny_model.py /tmp/tiny.gguf
    .venv/bin/python scripts/bench.py jobs --model /tmp/tiny.gguf --parallel 16 --lines 2000 --rss-lines 100000

`--cbatch-flags '--cache-ram 0'` runs the daemon without its host-memory tier, which keeps
the KV states of the lines' prompts (up to --cache-ram) and so is part of the memory figure.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benches.callers import percentiles_ms, prompts
from benches.options import REQUIRED, bench_parser
from benches.peers import BIN_DIR, START_TIMEOUT_S, free_port
from benches.proc_cpu import process_cpu_s
from benches.report import Table, note
from cbatch.jobs.files import MAX_FILE_LINES

LOADGEN = Path(__file__).resolve().parent / "loadgen.py"
POLL_S = 0.1  # how often a job is polled: light beside the daemon's work
RSS_SAMPLE_S = 0.2
KILL_AFTER_LINES = 2  # the daemon is killed once its job has finished this many lines
FINAL = ("completed", "failed", "expired", "cancelled")


def tree_pids(pid: int) -> list[int]:
    """The process and all its descendants."""
    pids, at = [pid], 0
    while at < len(pids):
        try:
            with open(f"/proc/{pids[at]}/task/{pids[at]}/children") as children:
                pids += [int(child) for child in children.read().split()]
        except FileNotFoundError:
            pass
        at += 1
    return pids


def tree_rss_mb(pid: int) -> float:
    """The resident memory of the process tree (shared pages counted in each process)."""
    total_kb = 0
    for each in tree_pids(pid):  # a process gone meanwhile, or a zombie (no VmRSS), counts nothing
        with contextlib.suppress(FileNotFoundError, StopIteration), open(f"/proc/{each}/status") as status:
            total_kb += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return total_kb / 1024


class Daemon:
    """cbatch-worker with --http on `state_dir`, started and waited for."""

    def __init__(self, model: str, args, state_dir: str):
        self.workdir = Path(tempfile.mkdtemp(prefix="cbj-"))
        self.endpoint = f"ipc://{self.workdir / 'cbatch.sock'}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(self.workdir), "CBATCH_ENDPOINT": self.endpoint}
        self.log = open(self.workdir / "daemon.log", "w")
        self.process = subprocess.Popen(
            [str(BIN_DIR / "cbatch-worker"), "-m", model, "-np", str(args.parallel), "-t", str(args.threads),
             "--http", str(self.port), "--state-dir", state_dir, *args.cbatch_flags.split()],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the daemon did not start: {(self.workdir / 'daemon.log').read_text()}")

    def create_job(self, lines: list[str]) -> str:
        upload = self.http.post("/v1/files", files={"file": ("in.jsonl", "".join(lines).encode())},
                                data={"purpose": "batch"})
        upload.raise_for_status()
        batch = self.http.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                    "endpoint": "/v1/completions", "completion_window": "24h"})
        batch.raise_for_status()
        return batch.json()["id"]

    def runner_pid(self) -> int:
        for pid in tree_pids(self.process.pid):
            with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"cbatch.jobs.job_runner" in cmdline.read():
                    return pid
        raise RuntimeError("the daemon runs no job runner")

    def batch(self, batch_id: str) -> dict:
        return self.http.get(f"/v1/batches/{batch_id}").json()

    def wait(self, batch_ids: list[str], is_done=lambda batch: batch["status"] in FINAL) -> list[dict]:
        batches = [self.batch(batch_id) for batch_id in batch_ids]
        while not all(is_done(batch) for batch in batches):
            time.sleep(POLL_S)
            batches = [self.batch(batch_id) for batch_id in batch_ids]
        return batches

    def stop(self, sig=signal.SIGTERM) -> None:
        pids = tree_pids(self.process.pid)
        self.process.send_signal(sig)
        self.process.wait(timeout=60)
        self.http.close()
        self.log.close()
        deadline = time.monotonic() + 60  # its children notice it is gone and exit
        while any(os.path.exists(f"/proc/{pid}") and not _is_zombie(pid) for pid in pids[1:]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of the daemon outlived it: {pids[1:]}")
            time.sleep(0.01)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def batch_lines(num_lines: int, max_tokens: int, prefix: str = "") -> list[str]:
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return [json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/completions",
                        "body": {**body, "prompt": prompt}}) + "\n" for i, prompt in enumerate(prompts(num_lines))]


def submit_tok_s(daemon: Daemon, path: str, out_dir: str) -> tuple[float, float]:
    """cbatch-submit's own figure (its tokens over its run, start-up not counted) and its CPU seconds."""
    before = os.times()
    done = subprocess.run([str(BIN_DIR / "cbatch-submit"), path, "-o", os.path.join(out_dir, "out.jsonl")],
                          env=daemon.env, capture_output=True, text=True, check=True)
    after = os.times()
    cpu_s = after.children_user + after.children_system - before.children_user - before.children_system
    return float(done.stderr.rsplit("(", 1)[1].split(" tok/s")[0]), cpu_s


def job_tok_s(daemon: Daemon, lines: list[str]) -> tuple[float, float]:
    """From the POST that creates the job to the poll that sees it completed; and the job runner's CPU seconds."""
    runner_pid = daemon.runner_pid()
    cpu_before, started = process_cpu_s(runner_pid), time.perf_counter()
    batch = daemon.wait([daemon.create_job(lines)])[0]
    elapsed_s = time.perf_counter() - started
    assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 0, batch
    return batch["progress"]["generated_tokens"] / elapsed_s, process_cpu_s(runner_pid) - cpu_before


def throughput(daemon: Daemon, args) -> None:
    lines = batch_lines(args.lines, args.max_tokens)
    out_dir = tempfile.mkdtemp(prefix="cbj-out-")
    path = os.path.join(out_dir, "in.jsonl")
    Path(path).write_text("".join(lines))
    submit_tok_s(daemon, path, out_dir)  # warm-up
    submits, jobs = [], []
    for _ in range(2):
        submits.append(submit_tok_s(daemon, path, out_dir))
        jobs.append(job_tok_s(daemon, lines))
    shutil.rmtree(out_dir)
    ratio = sum(tok_s for tok_s, _ in jobs) / sum(tok_s for tok_s, _ in submits)
    figures = Table(f"Throughput, {args.lines} lines x {args.max_tokens} tokens, each way run twice in turn (a job's "
                    "caller is its job runner)", "way", "run 1 tok/s", "run 2 tok/s", "caller CPU ms/line",
                    widths={"way": 13})
    for name, runs in (("cbatch-submit", submits), ("batch job", jobs)):
        cpu_ms_per_line = 1000 * sum(cpu_s for _, cpu_s in runs) / (len(runs) * args.lines)
        figures.row(name, *(tok_s for tok_s, _ in runs), cpu_ms_per_line)
    note(f"batch job / cbatch-submit, tok/s over both runs: {ratio:.2f}x")


def ttfts(daemon: Daemon, args) -> list[float]:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as prompts_file:
        json.dump([f"Probe {i}: say something." for i in range(args.ttft_probes)], prompts_file)
        prompts_file.flush()
        done = subprocess.run([sys.executable, str(LOADGEN), "--url", daemon.url, "--prompts", prompts_file.name,
                               "--body", json.dumps({"max_tokens": 8, "temperature": 0}),
                               "--clients", str(args.ttft_callers), "--stream"], capture_output=True, text=True,
                              check=True)
    result = json.loads(done.stdout)
    if result["errors"]:
        raise RuntimeError(result["errors"][:3])
    return result["ttft_s"]


def ttft(daemon: Daemon, args) -> None:
    figures = Table(f"Interactive TTFT, {args.ttft_probes} streamed requests from {args.ttft_callers} callers", "load",
                    "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", widths={"load": 20})
    idle = ttfts(daemon, args)
    figures.row("idle", *percentiles_ms(idle))
    batch_id = daemon.create_job(batch_lines(min(20 * args.lines, MAX_FILE_LINES),
                                             args.max_tokens))  # outlasts the probes
    daemon.wait([batch_id], lambda batch: batch["status"] != "validating")
    loaded = ttfts(daemon, args)
    running = daemon.batch(batch_id)
    daemon.http.post(f"/v1/batches/{batch_id}/cancel")
    daemon.wait([batch_id])
    ratio = np.percentile(loaded, 99) / np.percentile(idle, 99)
    figures.row("beside a running job", *percentiles_ms(loaded))
    note(f"TTFT p99 beside a running job / idle {ratio:.2f}x (the job was {running['status']}, "
         f"{running['request_counts']['completed']} lines done)")


def memory(daemon: Daemon, args) -> None:
    idle_mb = tree_rss_mb(daemon.process.pid)
    peak_mb, is_running = idle_mb, True

    def sample() -> None:
        nonlocal peak_mb
        while is_running:
            peak_mb = max(peak_mb, tree_rss_mb(daemon.process.pid))
            time.sleep(RSS_SAMPLE_S)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    sizes = [min(MAX_FILE_LINES, args.rss_lines - at) for at in range(0, args.rss_lines, MAX_FILE_LINES)]
    batch_ids = [daemon.create_job(batch_lines(size, 1, f"j{j}-")) for j, size in enumerate(sizes)]
    batches = daemon.wait(batch_ids)
    elapsed_s = time.perf_counter() - started
    is_running = False
    sampler.join()
    num_done = sum(batch["request_counts"]["completed"] for batch in batches)
    figures = Table("Memory, lines of 1 token queued at once: the daemon's RSS", "lines", "jobs", "completed",
                    "wall s", "lines/s", "min for 1M lines", "RSS idle MB", "RSS peak MB", "above idle MB")
    figures.row(args.rss_lines, len(sizes), num_done, elapsed_s, num_done / elapsed_s,
                1e6 / (num_done / elapsed_s) / 60, idle_mb, peak_mb, peak_mb - idle_mb)


def restart(model: str, args, state_dir: str) -> None:
    daemon = Daemon(model, args, state_dir)
    batch_id = daemon.create_job(batch_lines(args.kill_lines, args.max_tokens, "k"))
    log_path = Path(state_dir) / "batches" / f"{batch_id}.results.jsonl"
    # The results log, not request_counts (written every half second), says when to kill: a fast machine
    # finishes hundreds of lines between two writes of the counts.
    deadline = time.monotonic() + START_TIMEOUT_S
    while not log_path.exists() or log_path.read_bytes().count(b"\n") < KILL_AFTER_LINES:
        if time.monotonic() > deadline:
            raise RuntimeError("the job finished no line")
        time.sleep(0.005)
    daemon.stop(signal.SIGKILL)
    num_before = log_path.read_bytes().count(b"\n")
    if num_before >= args.kill_lines:
        raise RuntimeError(f"the job had ended before the kill: give it more than {args.kill_lines} --kill-lines")
    started, ready = time.perf_counter(), {}

    def start() -> None:  # timed from the start of the process, not from its /health
        ready["daemon"] = Daemon(model, args, state_dir)
        ready["s"] = time.perf_counter() - started

    threading.Thread(target=start, daemon=True).start()
    deadline = time.monotonic() + 2 * START_TIMEOUT_S
    while not log_path.exists() or log_path.read_bytes().count(b"\n") <= num_before:
        if time.monotonic() > deadline:
            raise RuntimeError("the restarted daemon finished no line")
        time.sleep(0.005)
    first_line_s = time.perf_counter() - started
    while "s" not in ready:
        time.sleep(0.05)
    again = ready["daemon"]
    batch = again.wait([batch_id])[0]
    again.stop()
    figures = Table("Restart after kill -9 mid-job, times from the new daemon's start", "lines", "done at kill",
                    "first new line s", "/health 200 s", "job then", "lines done")
    figures.row(args.kill_lines, num_before, first_line_s, ready["s"], batch["status"],
                batch["request_counts"]["completed"])


def main(argv=None) -> None:
    parser = bench_parser(__doc__, model=REQUIRED, parallel=16, max_tokens=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lines", type=int, default=2000, help="lines of the throughput file")
    parser.add_argument("--ttft-probes", type=int, default=200)
    parser.add_argument("--ttft-callers", type=int, default=8, help="interactive callers, each one request at a time")
    parser.add_argument("--rss-lines", type=int, default=100_000, help="lines run for the memory figure")
    parser.add_argument("--kill-lines", type=int, default=400, help="lines of the job killed mid-way")
    parser.add_argument("--cbatch-flags", default="", help="more cbatch-worker flags, e.g. '--cache-ram 0'")
    args = parser.parse_args(argv)
    state_dir = tempfile.mkdtemp(prefix="cbj-state-")
    try:
        daemon = Daemon(args.model, args, state_dir)
        try:
            throughput(daemon, args)
            ttft(daemon, args)
            memory(daemon, args)
        finally:
            daemon.stop()
        restart(args.model, args, state_dir)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)

