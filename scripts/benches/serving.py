"""Every way of reaching cbatch beside llama-server, with callers too light to be the
bottleneck, in one run: at each --threads setting and --parallel level, a closed loop of
--clients callers (short prompts, greedy with ignore_eos, --max-tokens each), as generated
tok/s through

    one Client's batch      generate_batch(max_in_flight=--clients), in this process
    threads                 --clients threads with a Client each (a threaded web app)
    AsyncClient             --clients coroutines sharing one AsyncClient (an asyncio app)
    HTTP whole / streamed   /v1/completions from scripts/benches/loadgen.py, a separate process of
                            raw kept-alive sockets on one thread; "new conn" opens a
                            connection per request, as curl and many scripts do
    llama-server            the same three HTTP ways (--llama-server PATH)

with each path's ratio to llama-server's same way (the ZeroMQ paths to its kept-alive
whole responses) and the CPU it cost per generated token, in microseconds: the caller
(this process, or the load generator), cbatch's front-end, HTTP processes, the decode
worker's main thread (the engine loop, which also computes its share of each llama_decode:
the wall time inside llama_decode is printed beside it) and its other threads (mostly
llama.cpp's compute), and llama-server in total. Two more tables per setting: each streamed
path's time to first token (p50, p90, p99), and the decode worker's steps during each cbatch
path (tokens a step, and a step's ms split into llama_decode and the host work outside it).
A load generator that used more than a third of a core is flagged in a note: its server's
figure is then suspect.

    .venv/bin/python scripts/make_tiny_model.py /tmp/tiny.gguf
    scripts/build_llama_server.sh
    .venv/bin/python scripts/bench.py serving --model /tmp/tiny.gguf --parallel 64 --threads 2 1 \
        --llama-server build/llama-server/bin/llama-server
"""

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benches import peers, proc_cpu
from benches.callers import closed_loop, one_client_batch, percentiles_ms, prompts, zmq_sender
from benches.options import bench_parser
from benches.peers import CbatchDaemon, LlamaServer, free_port, wait_http
from benches.report import Table, note
from cbatch.client import AsyncClient, Client
from cbatch.model import resolve_model_path

CTX_PER_SEQ = 1024
LOADGEN = Path(__file__).resolve().parent / "loadgen.py"
HTTP_WAYS = (("whole", []), ("streamed", ["--stream"]), ("whole, new conn", ["--new-connections"]))
MAX_CALLER_CORE_SHARE = 1 / 3
# The parts whose CPU a path cost, each with its column's name (microseconds per generated token).
CPU_COLUMNS = {"caller": "caller us/tok", "front-end": "front-end us/tok", "HTTP processes": "HTTP procs us/tok",
               "worker main thread": "worker main us/tok", "llama_decode wall": "decode wall us/tok",
               "worker other threads": "worker other us/tok", "server": "server us/tok"}
STEP_COLUMNS = ("steps", "tokens/step", "step ms", "llama_decode ms", "host ms")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def llama_decode_s(stats: dict) -> float:
    """The decode worker's seconds inside llama_decode so far, from its step statistics."""
    return stats["decode_fraction"] * stats["avg_step_ms"] / 1000 * stats["num_steps"]


def worker_steps(before: dict, after: dict) -> tuple:
    """The decode worker's steps between two stats, as STEP_COLUMNS: their number, tokens a
    step, and the wall time of a step split into llama_decode and the host work outside it
    (where a GPU's decode is a few ms, the host part is what the loop adds to every token)."""
    num_steps = after["num_steps"] - before["num_steps"]
    if num_steps <= 0:
        return num_steps, None, None, None, None
    step_ms = (after["avg_step_ms"] * after["num_steps"] - before["avg_step_ms"] * before["num_steps"]) / num_steps
    decode_ms = 1000 * (llama_decode_s(after) - llama_decode_s(before)) / num_steps
    tokens = (after["generated_tokens"] - before["generated_tokens"]) / num_steps
    return num_steps, tokens, step_ms, decode_ms, step_ms - decode_ms


def async_callers(endpoint: str, work: list[str], max_tokens: int, num_clients: int) -> float:
    """tok/s of num_clients coroutines, each sending its share in turn through one AsyncClient."""
    async def run() -> float:
        async with await AsyncClient.connect(endpoint) as client:
            counts = []

            async def caller(i: int) -> None:
                for prompt in work[i::num_clients]:
                    reply = await client.generate(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                    counts.append(reply.usage["completion_tokens"])

            started = time.perf_counter()
            await asyncio.gather(*(caller(i) for i in range(num_clients)))
            return sum(counts) / (time.perf_counter() - started)

    return asyncio.run(run())


def loadgen(url: str, prompts_path: str, args, extra: list[str]) -> tuple[float, float, list[float]]:
    """(tok/s, the load generator's CPU seconds, TTFTs) of one HTTP way."""
    body = json.dumps({"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True})
    done = subprocess.run([sys.executable, str(LOADGEN), "--url", url, "--prompts", prompts_path, "--body", body,
                           "--clients", str(args.clients), *extra], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    if result["errors"]:
        raise RuntimeError(f"{url}: {result['errors'][:3]}")
    return result["requests"] * args.max_tokens / result["elapsed_s"], result["cpu_s"], result["ttft_s"]


class Measured:
    """The tables' rows, per path: tok/s, CPU per token by part, TTFT percentiles (streamed
    paths), the decode worker's steps (cbatch's paths); and notes."""

    def __init__(self):
        self.tok_s: dict[str, float] = {}
        self.cpu_us: dict[str, dict[str, float]] = {}
        self.ttft_ms: dict[str, list[float]] = {}
        self.steps: dict[str, tuple] = {}
        self.notes: list[str] = []

    def add(self, name: str, tok_s: float, elapsed_s: float, num_tokens: int, cpu_s: dict[str, float],
            ttfts: list[float]) -> None:
        self.tok_s[name] = tok_s
        if ttfts:
            self.ttft_ms[name] = percentiles_ms(ttfts)
        self.cpu_us[name] = {part: 1e6 * seconds / num_tokens for part, seconds in cpu_s.items()}
        if cpu_s.get("caller", 0.0) > MAX_CALLER_CORE_SHARE * elapsed_s:
            self.notes.append(f"{name}: the caller used {cpu_s['caller'] / elapsed_s:.0%} of a core")


def measure_cbatch(model_path: str, parallel: int, threads: int, args, work: list[str], prompts_path: str,
                   measured: Measured) -> int:
    port = free_port()
    daemon = CbatchDaemon(model_path, parallel, ["--http", str(port), "-c", str(CTX_PER_SEQ * parallel),
                                                 "-t", str(threads)], dict(args.daemon_env))
    endpoint, url, num_tokens = daemon.endpoint, f"http://127.0.0.1:{port}", len(work) * args.max_tokens
    try:
        wait_http(url)
        with Client(endpoint) as client:
            prompt_tokens = client.generate(prompt=work[0], max_tokens=1).usage["prompt_tokens"]
        closed_loop(work[:args.clients], args.clients, zmq_sender(endpoint, 8))  # warm-up

        def timed(name: str, run) -> None:
            stats_before, parts_before = daemon.stats(), proc_cpu.cbatch_cpu_s(daemon.process.pid)
            own_before, started = own_cpu_s(), time.perf_counter()
            tok_s, caller_cpu_s, ttfts = run()
            elapsed_s = time.perf_counter() - started
            parts = proc_cpu.difference(proc_cpu.cbatch_cpu_s(daemon.process.pid), parts_before)
            stats_after = daemon.stats()
            parts["llama_decode wall"] = llama_decode_s(stats_after) - llama_decode_s(stats_before)
            caller = caller_cpu_s if caller_cpu_s is not None else own_cpu_s() - own_before
            measured.add(name, tok_s, elapsed_s, num_tokens, {"caller": caller, **parts}, ttfts)
            measured.steps[name] = worker_steps(stats_before, stats_after)

        timed("one Client, generate_batch",
              lambda: (one_client_batch(endpoint, work, args.max_tokens, args.clients), None, []))
        timed(f"{args.clients} threads, a Client each",
              lambda: (closed_loop(work, args.clients, zmq_sender(endpoint, args.max_tokens))[0], None, []))
        timed(f"AsyncClient, {args.clients} coroutines",
              lambda: (async_callers(endpoint, work, args.max_tokens, args.clients), None, []))
        for way, extra in HTTP_WAYS:
            timed(f"cbatch HTTP {way}", lambda: loadgen(url, prompts_path, args, extra))
    finally:
        daemon.stop()
    return prompt_tokens


def measure_llama_server(model_path: str, parallel: int, threads: int, args, work: list[str], prompts_path: str,
                         measured: Measured) -> None:
    server = LlamaServer(model_path, parallel, CTX_PER_SEQ, threads, args.clients)
    url, num_tokens = f"http://127.0.0.1:{server.port}", len(work) * args.max_tokens
    try:
        loadgen(url, prompts_path, argparse.Namespace(**{**vars(args), "max_tokens": 8}), [])  # warm-up
        for way, extra in HTTP_WAYS:
            server_before, started = proc_cpu.process_cpu_s(server.process.pid), time.perf_counter()
            tok_s, caller_cpu_s, ttfts = loadgen(url, prompts_path, args, extra)
            cpu_s = {"caller": caller_cpu_s, "server": proc_cpu.process_cpu_s(server.process.pid) - server_before}
            measured.add(f"llama-server HTTP {way}", tok_s, time.perf_counter() - started, num_tokens, cpu_s, ttfts)
    finally:
        server.stop()


def peer_of(name: str) -> str:
    way = name.removeprefix("cbatch HTTP ") if name.startswith("cbatch HTTP ") else "whole"
    return f"llama-server HTTP {way}"


def print_tables(setting: str, setup: str, measured: Measured) -> None:
    """The setting's tables, once every path is measured: a cbatch path's ratio needs
    llama-server's figure, measured after it."""
    paths = Table(f"paths at {setting}: {setup}; CPU in microseconds per generated token", "path", "tok/s",
                  "/server", *CPU_COLUMNS.values(), widths={"path": 34})
    for name, tok_s in measured.tok_s.items():
        peer = measured.tok_s.get(peer_of(name))
        ratio = tok_s / peer if peer and not name.startswith("llama-server") else None
        paths.row(name, tok_s, ratio, *(measured.cpu_us[name].get(part) for part in CPU_COLUMNS))
    ttft = Table(f"time to first token at {setting}", "path", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
                 widths={"path": 34})
    for name, ttft_ms in measured.ttft_ms.items():
        ttft.row(name, *ttft_ms)
    steps = Table(f"the decode worker's steps at {setting}", "path", *STEP_COLUMNS, widths={"path": 34})
    for name, figures in measured.steps.items():
        steps.row(name, *figures)
    for text in measured.notes:
        note(text)


def name_value(text: str) -> tuple[str, str]:
    name, is_set, value = text.partition("=")
    if not name or not is_set:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def main(argv=None) -> None:
    parser = bench_parser(__doc__, parallel=[64])
    parser.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count(), max(1, os.cpu_count() - 1)],
                        help="llama.cpp compute threads, the same for both servers (default: all cores, then one "
                             "core left to the host processes)")
    parser.add_argument("--clients", type=int, default=64, help="closed-loop callers on every path")
    parser.add_argument("--requests", type=int, default=768, help="requests per path (default 64 callers x 12)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--llama-server", default="", help="a llama-server binary to compare with")
    parser.add_argument("--daemon-env", action="append", default=[], type=name_value, metavar="NAME=VALUE",
                        help="an environment variable for cbatch's daemon only (repeatable)")
    args = parser.parse_args(argv)
    if args.llama_server:
        peers.LLAMA_SERVER = Path(args.llama_server)
    model_path = resolve_model_path(args.model)
    work = prompts(args.requests)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as prompts_file:
        json.dump(work, prompts_file)
        prompts_file.flush()
        for threads in args.threads:
            for parallel in args.parallel:
                measured = Measured()
                prompt_tokens = measure_cbatch(model_path, parallel, threads, args, work, prompts_file.name, measured)
                if args.llama_server:
                    measure_llama_server(model_path, parallel, threads, args, work, prompts_file.name, measured)
                print_tables(f"--threads {threads}, --parallel {parallel}",
                             f"model {Path(model_path).name}, {args.requests} requests x {args.max_tokens} tokens "
                             f"(greedy, ignore_eos), {prompt_tokens}-token prompts, {args.clients} closed-loop "
                             "callers", measured)

