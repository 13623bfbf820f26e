"""Whole-system benchmark: the same workload in-process, through cbatch-submit, and through
N concurrent Clients, in one run; plus token delivery latency and idle reader CPU.

Latency is measured by the local clients from the ring's publish stamp (written by the
worker just before it moves the write cursor) to the moment the client has read the
records; a step's sampling precedes its publish by that step's postprocessing only.

Prints the setup; a row per path, its tokens/s and their ratio to the in-process engine's
(the mean of a run before the other paths and one after them, both in a note); the
delivery latency's percentiles for one Client and for --parallel Clients; and the % of a
core a client process waiting for its token uses, with no traffic and while --parallel
other requests stream.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benches import callers
from benches.engine import make_prompts
from benches.options import bench_parser
from benches.peers import BIN_DIR, CbatchDaemon
from benches.proc_cpu import process_cpu_s
from benches.report import Table, note
from cbatch.client import Client
from cbatch.config import EngineConfig
from cbatch.model import resolve_model_path
from cbatch.params import parse_request
from cbatch.workers.engine.engine import Engine

IDLE_WINDOW_S = 5.0


def run_in_process(model_path, parallel, bodies) -> float:
    engine = Engine(EngineConfig(model_path=model_path, parallel=parallel, ctx_size=1024 * parallel))
    try:
        for i, body in enumerate(bodies):
            engine.add_request(parse_request(i + 1, body))
        started, num_tokens = time.perf_counter(), 0
        while engine.has_work:
            num_tokens += sum(len(out.token_ids) for out in engine.step())
        return num_tokens / (time.perf_counter() - started)
    finally:
        engine.close()


def run_submit(env, bodies, workdir: Path) -> float:
    prompts, results = workdir / "prompts.jsonl", workdir / "results.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, **b}) + "\n" for i, b in enumerate(bodies)))
    started = time.perf_counter()
    subprocess.run([str(BIN_DIR / "cbatch-submit"), str(prompts), "-o", str(results), "--max-in-flight", "64"],
                   env=env, check=True, stderr=subprocess.DEVNULL)
    elapsed = time.perf_counter() - started
    num_tokens = sum(json.loads(line)["usage"]["completion_tokens"] for line in results.read_text().splitlines())
    return num_tokens / elapsed


def run_one_client(endpoint, bodies) -> tuple[float, list[int]]:
    """One Client streaming every request (stream_batch): one reader wakes per step."""
    with Client(endpoint) as client:
        latencies = client._session.read_latencies_ns = []
        started, num_tokens = time.perf_counter(), 0
        for _, chunk in client.stream_batch(bodies, max_in_flight=len(bodies)):
            num_tokens += len(chunk.token_ids)
        return num_tokens / (time.perf_counter() - started), latencies


def run_clients(endpoint, bodies, num_clients) -> tuple[float, list[int]]:
    """num_clients Clients in threads of this process, each streaming its share of requests
    (a stream's records wake its reader as they arrive; generate()'s wait for the end):
    all of them wake on every step's tick and take turns on the GIL."""
    latencies: list[int] = []
    counts = [0] * num_clients
    clients = [Client(endpoint) for _ in range(num_clients)]
    for client in clients:
        client._session.read_latencies_ns = latencies

    def work(k):
        for body in bodies[k::num_clients]:
            counts[k] += sum(len(chunk.token_ids) for chunk in clients[k].stream(**body))

    elapsed = callers.run_clients(num_clients, work)
    for client in clients:
        client.close()
    return sum(counts) / elapsed, latencies


def idle_reader_cpu(env, parallel: int) -> tuple[float, float]:
    """% of a core used by a client process blocked waiting for a token of its own:
    with no traffic at all (the worker is paused with SIGSTOP) and while `parallel` other
    requests stream (its request is queued behind them, woken by every step's tick)."""
    waiter = "import cbatch; cbatch.Client().generate(prompt='wait', max_tokens=1)"
    blocker = "import cbatch; cbatch.Client().generate(prompt='busy', max_tokens=400, ignore_eos=True)"
    with Client(env["CBATCH_ENDPOINT"]) as probe:
        worker_pid = probe.health()["worker_pid"]
    results = []
    for with_traffic in (False, True):
        blockers = [subprocess.Popen([sys.executable, "-c", blocker],
                                     env=env) for _ in range(parallel if with_traffic else 0)]
        time.sleep(2.0)  # blockers admitted
        if not with_traffic:
            os.kill(worker_pid, signal.SIGSTOP)
        proc = subprocess.Popen([sys.executable, "-c", waiter], env=env)
        time.sleep(2.0)  # connected and waiting
        before = process_cpu_s(proc.pid)
        time.sleep(IDLE_WINDOW_S)
        results.append(100 * (process_cpu_s(proc.pid) - before) / IDLE_WINDOW_S)
        if not with_traffic:
            os.kill(worker_pid, signal.SIGCONT)
        for p in blockers + [proc]:
            p.kill()
            p.wait()
    return results[0], results[1]


def main() -> None:
    parser = bench_parser(__doc__, parallel=16, requests=32, prompt_tokens=128, max_tokens=64)
    args = parser.parse_args()

    model_path = resolve_model_path(args.model)
    counter = Engine(EngineConfig(model_path=model_path, parallel=1, ctx_size=1024))
    prompts = make_prompts(lambda text: len(counter.runner.tokenize(text)), args.requests, args.prompt_tokens)
    counter.close()
    bodies = [{"prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True} for p in prompts]

    daemon = CbatchDaemon(model_path, args.parallel, ["--ctx-size", str(1024 * args.parallel)])
    env, endpoint = daemon.env, daemon.endpoint
    try:
        note(f"model {model_path}; parallel {args.parallel}; {args.requests} requests of ~{args.prompt_tokens} prompt "
             f"tokens, {args.max_tokens} generated, greedy")
        in_process = run_in_process(model_path, args.parallel, bodies)
        submit = run_submit(env, bodies, daemon.workdir)
        one, one_latencies = run_one_client(endpoint, bodies)
        clients, latencies = run_clients(endpoint, bodies, args.parallel)
        in_process_again = run_in_process(model_path, args.parallel, bodies)
        reference = (in_process + in_process_again) / 2
        throughput = Table("Throughput by path", "path", "tok/s", "x in-process", widths={"path": 34})
        for name, value in (("in-process engine (mean of 2)", reference), ("cbatch-submit", submit),
                            ("1 Client, stream_batch", one),
                            (f"{args.parallel} concurrent Clients (threads)", clients)):
            throughput.row(name, value, value / reference)
        note(f"in-process runs: {in_process:.1f} and {in_process_again:.1f} tok/s")
        delivery = Table("Delivery latency, ring publish -> read", "readers", "reads", "p50 ms", "p99 ms", "max ms",
                         widths={"readers": 11})
        for name, values in (("1 Client", one_latencies), (f"{args.parallel} Clients", latencies)):
            lat_ms = np.array(values) / 1e6
            delivery.row(name, len(lat_ms), np.percentile(lat_ms, 50), np.percentile(lat_ms, 99), lat_ms.max())
        quiet, busy = idle_reader_cpu(env, args.parallel)
        idle_cpu = Table(f"Idle reader CPU over {IDLE_WINDOW_S:.0f} s", "traffic", "% of a core",
                         widths={"traffic": 27})
        idle_cpu.row("none", quiet)
        idle_cpu.row(f"{args.parallel} other requests streaming", busy)
    finally:
        daemon.stop()

