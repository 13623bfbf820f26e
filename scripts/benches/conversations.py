"""Conversations that come back, side by side: --conversations conversations x --turns turns
over --parallel slots, each its own history after a shared system text, against llama.cpp's
llama-server with its defaults (its host-memory prompt cache on) when it is built
(scripts/build_llama_server.sh; skipped with a note otherwise).

A closed loop: every conversation runs on a thread of its own and sends its next turn once
the last is answered: POST /v1/completions, streamed, greedy, ignore_eos, --answer-tokens
generated; the next turn's prompt is the last prompt, its answer and a new user line.
Printed, a row for each server: the wall time, the later turns' time to first token
(median and p99), the prompt tokens computed per turn (the prompt less the cached tokens
both servers report in usage.prompt_tokens_details), the server's RSS at the end, the CPU
this bench's callers used (they share the host with the server) and cbatch's hits per
cache tier; then cbatch's ratios to llama-server, as a note.

--restart N: a third run, of cbatch with --cache-dir: after turn N its daemon stops and a
new one starts on the same directory. Turn N+1 is sent first to a fresh daemon without the
directory (cold), then to the restarted one (from disk), and the run goes on from there:
a table of its own, a row for each of the two daemons.

    .venv/bin/python scripts/bench.py conversations [--conversations 16 --turns 4 --parallel 4] \\
        [--restart 2] [--runs 2] [--model GGUF] [--cbatch-flags '--kv-unified']
"""

import http.client
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from benches.callers import run_clients
from benches.long_prompts import Texts
from benches.options import bench_parser
from benches.peers import BIN_DIR, LLAMA_SERVER, START_TIMEOUT_S, free_port, wait_http
from benches.report import Table, note
from cbatch.model import resolve_model_path

TURN_TIMEOUT_S = 3600.0
CACHE_METRICS = {'cbatch_kv_cache_hits_total{tier="device"}': "device hits",
                 'cbatch_kv_cache_hits_total{tier="host"}': "host hits",
                 'cbatch_kv_cache_hits_total{tier="disk"}': "disk hits", "cbatch_kv_cache_misses_total": "misses",
                 "cbatch_host_cache_bytes": "host bytes"}



def rss_bytes(pid: int) -> int:
    """VmRSS of a process and its children (a cbatch daemon's decode worker is one)."""
    total = 0
    for one in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{one}/status") as status:
                total += next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
        except (FileNotFoundError, StopIteration):
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            found = [int(child) for child in children.read().split()]
    except FileNotFoundError:
        return []
    return found + [grandchild for child in found for grandchild in _children(child)]


class Server:
    """A started HTTP server process: cbatch-worker --http, or llama-server."""

    def __init__(self, argv: list[str], port: int, env: dict | None = None):
        self.port = port
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_http(f"http://127.0.0.1:{port}")
        except RuntimeError:
            self.stop()
            self.log.seek(0)
            raise RuntimeError(f"{argv[0]} did not start:\n{self.log.read().decode(errors='replace')[-3000:]}")

    def stats(self) -> dict:
        return {}

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Cbatch(Server):
    def __init__(self, model_path: str, parallel: int, flags: list[str]):
        self.workdir = Path(tempfile.mkdtemp(prefix="cbconv-"))
        port = free_port()
        env = {**os.environ, "XDG_RUNTIME_DIR": str(self.workdir),
               "CBATCH_ENDPOINT": f"ipc://{self.workdir / 'cbatch.sock'}"}
        super().__init__([str(BIN_DIR / "cbatch-worker"), "-m", model_path, "-np", str(parallel), "--http", str(port),
                          "--state-dir", str(self.workdir / "state"), "-q", *flags], port, env)

    def stats(self) -> dict:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
        connection.close()
        found = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in CACHE_METRICS:
                found[CACHE_METRICS[name]] = int(float(value))
        return found

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class LlamaServer(Server):
    def __init__(self, model_path: str, parallel: int, ctx_per_seq: int):
        port = free_port()
        super().__init__([str(LLAMA_SERVER), "-m", model_path, "-np", str(parallel), "-c", str(parallel * ctx_per_seq),
                          "-t", str(os.cpu_count() or 1), "--port", str(port), "--no-webui"], port)


class Turn:
    """One streamed completion: its time to first token, wall time, answer and usage."""

    def __init__(self, port: int, prompt: str, answer_tokens: int):
        body = json.dumps({"prompt": prompt, "max_tokens": answer_tokens, "temperature": 0, "ignore_eos": True,
                           "stream": True, "stream_options": {"include_usage": True}})
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TURN_TIMEOUT_S)
        started = time.perf_counter()
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        self.ttft_s = None
        pieces, self.usage = [], None
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: "):])
            if event.get("usage"):
                self.usage = event["usage"]
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    self.ttft_s = self.ttft_s or time.perf_counter() - started
                    pieces.append(choice["text"])
        self.wall_s = time.perf_counter() - started
        connection.close()
        self.answer = "".join(pieces)
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        self.num_computed = (self.usage or {}).get("prompt_tokens", 0) - (details.get("cached_tokens") or 0)


class Workload:
    """Each conversation's prompts, grown turn by turn from the answers."""

    def __init__(self, texts: Texts, num_conversations: int, system_tokens: int, history_tokens: int,
                 user_tokens: int):
        system = "You are a helpful assistant. Answer briefly.\n" + texts.words(system_tokens)
        self.prompts = [f"{system}\n\nConversation {i}.\n{texts.words(history_tokens)}\nUser: "
                        f"{texts.words(user_tokens)}\nAssistant:" for i in range(num_conversations)]
        self.user_lines = [[texts.words(user_tokens) for _ in range(64)] for _ in range(num_conversations)]

    def advance(self, conversation: int, turn: int, answer: str) -> None:
        self.prompts[conversation] += f"{answer}\nUser: {self.user_lines[conversation][turn % 64]}\nAssistant:"


def run_turns(server: Server, workload: Workload, turns: range, answer_tokens: int) -> dict[int, list[Turn]]:
    """Every conversation through `turns`, each on its own thread; the turns by number."""
    by_turn: dict[int, list[Turn]] = {turn: [] for turn in turns}
    lock = threading.Lock()

    def conversation(i: int) -> None:
        for turn in turns:
            done = Turn(server.port, workload.prompts[i], answer_tokens)
            with lock:
                by_turn[turn].append(done)
            workload.advance(i, turn, done.answer)

    run_clients(len(workload.prompts), conversation)
    return by_turn


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, round(0.99 * (len(values) - 1)))]


def summary(name: str, by_turn: dict[int, list[Turn]], wall_s: float, server: Server, cpu_s: float) -> dict:
    later = [t.ttft_s for turn, done in by_turn.items() if turn > 0 for t in done]
    computed = {turn: round(statistics.mean(t.num_computed for t in done)) for turn, done in by_turn.items()}
    return {"name": name, "wall_s": wall_s, "ttft_median_s": statistics.median(later) if later else 0.0,
            "ttft_p99_s": p99(later) if later else 0.0, "computed": computed,
            "rss_mb": rss_bytes(server.process.pid) / 1e6, "stats": server.stats(), "callers_cpu_s": cpu_s}


def cache_cells(stats: dict) -> list[int | None]:
    """A server's cache counters in CACHE_METRICS' order; None for one it does not report."""
    return [stats.get(name) for name in CACHE_METRICS.values()]


def callers_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(name: str, start, args, texts_seed: int, model_path: str) -> dict:
    workload = Workload(Texts(model_path, texts_seed), args.conversations, args.system_tokens, args.history_tokens,
                        args.user_tokens)
    server = start()
    try:
        cpu_before, started = callers_cpu_s(), time.perf_counter()
        by_turn = run_turns(server, workload, range(args.turns), args.answer_tokens)
        return summary(name, by_turn, time.perf_counter() - started, server, callers_cpu_s() - cpu_before)
    finally:
        server.stop()


def measure_restart(args, texts_seed: int, model_path: str) -> tuple[list[Turn], list[Turn], dict]:
    """cbatch with --cache-dir, stopped after turn --restart and started again on the directory:
    the turn after the restart sent cold and from the directory, and the restarted daemon's
    cache hits at the end."""
    cache_dir = tempfile.mkdtemp(prefix="cbconv-cache-")
    flags = [*args.cbatch_flags.split(), "--cache-dir", cache_dir]
    workload = Workload(Texts(model_path, texts_seed), args.conversations, args.system_tokens, args.history_tokens,
                        args.user_tokens)
    try:
        server = Cbatch(model_path, args.parallel, flags)
        try:
            run_turns(server, workload, range(args.restart), args.answer_tokens)
        finally:
            server.stop()
        saved = list(workload.prompts)
        cold_server = Cbatch(model_path, args.parallel, args.cbatch_flags.split())
        try:
            cold = run_turns(cold_server, workload, range(args.restart, args.restart + 1), args.answer_tokens)
        finally:
            cold_server.stop()
        workload.prompts = saved
        server = Cbatch(model_path, args.parallel, flags)
        try:
            warm = run_turns(server, workload, range(args.restart, args.turns), args.answer_tokens)
            stats = server.stats()
        finally:
            server.stop()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return cold[args.restart], warm[args.restart], stats


def main(argv=None) -> None:
    parser = bench_parser(__doc__, parallel=4)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=150)
    parser.add_argument("--history-tokens", type=int, default=1300)
    parser.add_argument("--user-tokens", type=int, default=20)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--ctx-per-seq", type=int, default=4096, help="llama-server's -c is this times --parallel")
    parser.add_argument("--cbatch-flags", default="", help="more cbatch-worker flags, e.g. '--kv-unified'")
    parser.add_argument("--configs", default="cbatch,llama-server", help="of cbatch, cbatch-no-tier, llama-server")
    parser.add_argument("--restart", type=int, default=0, metavar="N", help="the restart run, after turn N (0: none)")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    model_path = resolve_model_path(args.model)
    configs = args.configs.split(",")
    if "llama-server" in configs and not LLAMA_SERVER.exists():
        note(f"{LLAMA_SERVER} is not built (scripts/build_llama_server.sh): llama-server skipped")
        configs.remove("llama-server")
    starts = {
        "cbatch": lambda: Cbatch(model_path, args.parallel, args.cbatch_flags.split()),
        "cbatch-no-tier": lambda: Cbatch(model_path, args.parallel, [*args.cbatch_flags.split(), "--cache-ram", "0"]),
        "llama-server": lambda: LlamaServer(model_path, args.parallel, args.ctx_per_seq),
    }
    note(f"{args.conversations} conversations x {args.turns} turns over {args.parallel} slots: a "
         f"~{args.system_tokens}-token shared system text, ~{args.history_tokens} tokens of history each, "
         f"{args.user_tokens}-token user lines, {args.answer_tokens}-token answers; {os.cpu_count()} CPUs")
    turn_columns = [f"turn {turn + 1} computed" for turn in range(args.turns)]
    for run in range(args.runs):
        figures = Table(f"Run {run + 1}: each server's wall time, later turns' TTFT, prompt tokens computed per turn, "
                        "cache hits", "server", "wall s", "TTFT median s", "TTFT p99 s", *turn_columns, "RSS MB",
                        "callers CPU s", *CACHE_METRICS.values(), widths={"server": 14})
        rows = {}
        for name in configs:
            row = rows[name] = measure(name, starts[name], args, run, model_path)
            figures.row(name, row["wall_s"], row["ttft_median_s"], row["ttft_p99_s"], *row["computed"].values(),
                        row["rss_mb"], row["callers_cpu_s"], *cache_cells(row["stats"]))
        if "cbatch" in rows and "llama-server" in rows:
            cbatch, peer = rows["cbatch"], rows["llama-server"]
            note(f"run {run + 1}, cbatch / llama-server: speed (wall) {peer['wall_s'] / cbatch['wall_s']:.2f}x, "
                 f"later turns' TTFT median {cbatch['ttft_median_s'] / peer['ttft_median_s']:.2f}x")
        if args.restart:
            cold, warm, stats = measure_restart(args, run, model_path)
            cold_ttft, warm_ttft = (statistics.median(t.ttft_s for t in turns) for turns in (cold, warm))
            restart = Table(f"Run {run + 1}: restart after turn {args.restart}, turn {args.restart + 1} on a cold "
                            "daemon and on one restarted on --cache-dir", "daemon", "TTFT median s",
                            "prompt tokens computed", *CACHE_METRICS.values(), widths={"daemon": 16})
            restart.row("cold", cold_ttft, round(statistics.mean(t.num_computed for t in cold)), *cache_cells({}))
            restart.row("from --cache-dir", warm_ttft, round(statistics.mean(t.num_computed for t in warm)),
                        *cache_cells(stats))
            note(f"run {run + 1}, restart: turn {args.restart + 1} TTFT median from --cache-dir / cold "
                 f"{warm_ttft / cold_ttft:.2f}x")

