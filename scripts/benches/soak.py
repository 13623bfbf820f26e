"""Soak: thousands of mixed requests from many client processes against one daemon, with
cancels and killed clients mixed in. Prints the requests by how they ended (errors by
code), what was delivered against what the worker generated with the leaks, and the
memory of each daemon process, then SOAK PASSED or SOAK FAILED and why; exits 1 on any
loss, duplicate, leak or unexplained error.

    .venv/bin/python scripts/bench.py soak                      # 2000 requests, 32 clients, tiny model
    .venv/bin/python scripts/bench.py soak --model gemma --requests 200 --clients 8
    .venv/bin/python scripts/bench.py soak --ring-capacity 32   # ring readers lapped all the time: soaks their recovery
"""

import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benches.options import bench_parser
from benches.report import Table, note
from cbatch.client import Client
from cbatch.errors import CbatchError
from cbatch.model import resolve_model_path

BIN_DIR = Path(sys.executable).parent
CANCEL_FRACTION = 0.1
KILLED_CLIENT_FRACTION = 1 / 8
MEMORY_SAMPLE_S = 0.5
DAEMON_EXIT_WAIT_S = 10.0


def random_body(rng: random.Random, is_real_model: bool) -> dict:
    body = {"prompt": "".join(rng.choice("abcdefgh ijk") for _ in range(rng.randint(1, 300))),
            "max_tokens": rng.randint(1, 48 if is_real_model else 200), "seed": rng.randint(0, 1000)}
    body["temperature"] = rng.choice([0, 0.7, 1.2])
    if rng.random() < 0.3:
        body.update(top_k=rng.choice([0, 5, 40]), top_p=rng.choice([0.5, 0.9, 1.0]), min_p=rng.choice([0, 0.1]))
    if rng.random() < 0.2:
        body["repeat_penalty"] = 1.3
    if rng.random() < 0.2:
        body["stop"] = [rng.choice("abcdefgh") + rng.choice("abcdefgh")]
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    return body


def client_main(endpoint: str, seed: int, num_requests: int, out_path: str, is_real_model: bool) -> None:
    rng = random.Random(seed)
    results = []
    with Client(endpoint, use_ring=rng.random() < 0.7) as client:
        for _ in range(num_requests):
            stream = client.submit(**random_body(rng, is_real_model))
            cancel_after = rng.randint(1, 5) if rng.random() < CANCEL_FRACTION else None
            result = {"request_id": stream.request_id, "delivered": 0, "indices_ok": True}
            try:
                for number, chunk in enumerate(client.read(stream), 1):
                    result["delivered"] += len(chunk.token_ids)
                    if number == cancel_after:
                        client.cancel(stream.request_id)
                        result["cancel_sent"] = True
                    if chunk.finish_reason:
                        result.update(finish_reason=chunk.finish_reason, generated=chunk.usage["completion_tokens"])
            except CbatchError as err:
                result["error"] = err.code
            results.append(result)
    Path(out_path).write_text(json.dumps(results))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def healthy(endpoint: str, daemon: subprocess.Popen) -> dict | None:
    """The daemon's health once it is ok; None when the daemon exited first: it listens
    before it loads the model, so a model it cannot load ends it once its socket is up."""
    with Client(endpoint) as probe:
        while True:
            try:
                health = probe.health()
            except CbatchError:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    daemon.wait(DAEMON_EXIT_WAIT_S)  # a daemon that stopped answering as it exits
                if daemon.returncode is None:
                    raise
                return None
            if health["status"] == "ok":
                return health
            time.sleep(0.1)


def main() -> int:
    parser = bench_parser(__doc__, model=None, requests=2000, clients=32, parallel=8)
    parser.add_argument("--model", default="tiny", help="'tiny' (scripts/tiny_models/llama.py), 'gemma', or a path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ring-capacity", type=int, default=None, help="token ring records (default: the daemon's)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="cbatch-soak-"))
    if args.model == "tiny":
        from tiny_models.llama import make_tiny_model  # scripts/, the entry's folder
        model_path = make_tiny_model(str(workdir / "tiny.gguf"))
    else:
        model_path = resolve_model_path(None if args.model == "gemma" else args.model)

    endpoint = f"ipc://{workdir / 'soak.sock'}"
    env = {**os.environ, "CBATCH_ENDPOINT": endpoint, "XDG_RUNTIME_DIR": str(workdir)}
    ring_args = ["--ring-capacity", str(args.ring_capacity)] if args.ring_capacity else []
    daemon = subprocess.Popen([str(BIN_DIR / "cbatch-worker"), "--model", model_path, "--parallel", str(args.parallel),
                               "--ctx-size", str(1024 * args.parallel), *ring_args], env=env, stderr=subprocess.DEVNULL)
    try:
        return soak(args, daemon, workdir, model_path)
    finally:  # a soak that failed early leaves no daemon running and no files behind
        if daemon.poll() is None:
            daemon.terminate()
            daemon.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)


def soak(args, daemon: subprocess.Popen, workdir: Path, model_path: str) -> int:
    """The soak against a started daemon: its verdict, 0 when nothing was lost or leaked."""
    endpoint, is_real_model = f"ipc://{workdir / 'soak.sock'}", args.model != "tiny"
    failures: list[str] = []
    while not (workdir / "soak.sock").exists():
        if daemon.poll() is not None:
            note(f"SOAK FAILED: the daemon exited {daemon.returncode} before listening")
            return 1
        time.sleep(0.1)
    health = healthy(endpoint, daemon)
    if health is None:
        note(f"SOAK FAILED: the daemon exited {daemon.returncode} before it was healthy")
        return 1
    worker_pid, ring_name = health["worker_pid"], f"cbatch-{daemon.pid}"
    rng = random.Random(args.seed)
    per_client = [args.requests // args.clients + (i < args.requests % args.clients) for i in range(args.clients)]
    spawn = multiprocessing.get_context("spawn")
    clients = [spawn.Process(target=client_main, args=(endpoint, args.seed * 1000 + i, n, str(workdir / f"c{i}.json"),
                                                          is_real_model)) for i, n in enumerate(per_client)]
    to_kill = rng.sample(range(args.clients), max(1, int(args.clients * KILLED_CLIENT_FRACTION)))
    kill_at = {i: time.monotonic() + rng.uniform(1.0, 8.0) for i in to_kill}
    killed: set[int] = set()  # those still running when their time came
    peak = {"daemon": 0, "worker": 0}
    started = time.monotonic()
    for c in clients:
        c.start()
    while any(c.is_alive() for c in clients):
        for i, at in list(kill_at.items()):
            if time.monotonic() >= at:
                # One that already finished is left alone: its pid may be reaped, even reused.
                if clients[i].is_alive():
                    clients[i].kill()
                    killed.add(i)
                del kill_at[i]
        peak = {"daemon": max(peak["daemon"], rss_kib(daemon.pid)), "worker": max(peak["worker"], rss_kib(worker_pid))}
        time.sleep(MEMORY_SAMPLE_S)
    elapsed = time.monotonic() - started
    final = {"daemon": rss_kib(daemon.pid), "worker": rss_kib(worker_pid)}

    results = []
    for i, c in enumerate(clients):
        path = workdir / f"c{i}.json"
        if i in killed and c.exitcode == -signal.SIGKILL:
            continue
        if c.exitcode != 0 or not path.exists():
            failures.append(f"client {i} exited {c.exitcode}")
            continue
        results += json.loads(path.read_text())
    reasons, errors = Counter(), Counter()
    delivered = generated = mismatched = 0
    for r in results:
        if "error" in r:
            errors[r["error"]] += 1
            continue
        reasons[r["finish_reason"]] += 1
        delivered += r["delivered"]
        generated += r["generated"]
        if r["delivered"] != r["generated"]:
            mismatched += 1
        if r["finish_reason"] == "cancelled" and not r.get("cancel_sent"):
            failures.append(f"request {r['request_id']} cancelled without a cancel")
    if mismatched:
        failures.append(f"{mismatched} requests delivered a different number of tokens than were generated")
    if errors:
        failures.append(f"unexplained errors: {dict(errors)}")

    with Client(endpoint) as probe:  # the daemon is still whole
        if probe.health()["worker_pid"] != worker_pid:
            failures.append("the decode worker was restarted")
        num_fetches = probe.stats()["num_fetches"]
        if probe.generate(prompt="after the soak", max_tokens=5).usage["completion_tokens"] < 1:
            failures.append("a request after the soak failed")
    daemon.send_signal(signal.SIGTERM)
    exit_code = daemon.wait(60)
    leaks = [p for p in (Path(f"/dev/shm/{ring_name}"), workdir / "soak.sock") if p.exists()]
    leaks += [str(p) for p in workdir.glob(f"cbatch-{os.getuid()}/*")]
    if exit_code != 0:
        failures.append(f"daemon exited {exit_code}")
    if leaks:
        failures.append(f"leaked: {leaks}")
    try:
        os.kill(worker_pid, 0)
        failures.append("the decode worker outlived the daemon")
    except ProcessLookupError:
        pass

    note(f"soak: model {Path(model_path).name}, parallel {args.parallel}, ring capacity "
         f"{args.ring_capacity or 'default'}, {args.clients} client processes ({len(killed)} killed mid-run), "
         f"{args.requests} requests planned, {elapsed:.1f} s")
    outcomes = Table("Requests completed (by the clients not killed), by how they ended", "ended", "requests",
                     widths={"ended": 24})
    for reason, count in reasons.items():
        outcomes.row(f"finish_reason {reason}", count)
    for code, count in errors.items():
        outcomes.row(f"error {code}", count)
    checks = Table("Delivered against generated, and what the daemon left behind", "figure", "value",
                   widths={"figure": 38})
    checks.row("requests completed", len(results))
    checks.row("tokens delivered", delivered)
    checks.row("tokens generated", generated)
    checks.row("requests with a mismatch", mismatched)
    checks.row("FETCHes answered (lapped ring readers)", num_fetches)
    checks.row("leaked segments/sockets", len(leaks))
    checks.row("daemon exit code", exit_code)
    memory = Table("Memory of each daemon process", "process", "RSS peak MiB", "RSS final MiB")
    for process in ("daemon", "worker"):
        memory.row(process, peak[process] / 1024, final[process] / 1024)
    note("SOAK PASSED" if not failures else "SOAK FAILED: " + "; ".join(failures))
    return 1 if failures else 0

