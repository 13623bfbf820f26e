"""The daemon on a busy host: other CPU-bound processes beside it, one per core.

llama.cpp's compute threads spin at their barriers, so with as many threads as cores and
other processes wanting those cores a step can take many times as long as with one thread;
the daemon's default (--threads left out) drops to one thread while that lasts
(workers/engine/thread_governor.py). This runs the same requests (concurrent greedy
generations from one light client) against a daemon with the default threads, with `-t 1`
and with `-t N` (every core, the default's count), first with a CPU-bound busy loop per
core beside it, then on the quiet host. A table per host: each setting's wall time and
the compute threads it ended on; then notes: the daemon's log lines where its thread
governor acted, the default's ratio to the best fixed count, and the CPU the client used.

Usage: .venv/bin/python scripts/bench.py busy_host [--model PATH] [--requests 10] [--max-tokens 64]
"""

import multiprocessing
import resource
import time

from benches.options import bench_parser
from benches.peers import CbatchDaemon
from benches.report import Table, note
from cbatch.client import Client
from cbatch.config import num_usable_cpus
from cbatch.model import resolve_model_path


def busy_loop() -> None:
    while True:
        pass


def run_once(model: str, threads: list[str], args) -> tuple[float, int, str]:
    """(wall seconds for the requests, the compute threads the daemon ended on, its log's governor lines)."""
    daemon = CbatchDaemon(model, 4, ["-q", *threads])
    try:
        with Client(daemon.endpoint) as client:
            items = [{"prompt": f"Write about request {i}:", "max_tokens": args.max_tokens, "temperature": 0,
                      "ignore_eos": True} for i in range(args.requests)]
            started = time.perf_counter()
            results = client.generate_batch(items)
            wall_s = time.perf_counter() - started
            assert all(not isinstance(result, Exception) for result in results), results
            num_threads = client.stats().get("compute_threads", 0)
        lines = [line.strip() for line in (daemon.workdir / "daemon.log").read_text().splitlines()
                 if "compute threads got" in line]
    finally:
        daemon.stop()
    return wall_s, num_threads, "; ".join(lines)


def main(argv=None) -> None:
    parser = bench_parser(__doc__, requests=10, max_tokens=64)
    args = parser.parse_args(argv)
    num_cpus = num_usable_cpus()
    configs = {"default": [], "-t 1": ["-t", "1"], f"-t {num_cpus}": ["-t", str(num_cpus)]}
    note(f"{args.requests} concurrent requests of {args.max_tokens} tokens from one client, {num_cpus} usable CPUs")
    for is_busy in (True, False):
        host = "busy" if is_busy else "quiet"
        hogs = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(num_cpus if is_busy else 0)]
        for hog in hogs:
            hog.start()
        try:
            walls, governor_lines = {}, {}
            runs = Table(f"{host} host ({len(hogs)} busy loops beside the daemon)", "threads", "wall s",
                         "compute threads at the end", widths={"threads": 10})
            for name, threads in configs.items():
                wall_s, num_threads, governor_lines[name] = run_once(resolve_model_path(args.model), threads, args)
                walls[name] = wall_s
                runs.row(name, wall_s, num_threads)
        finally:
            for hog in hogs:
                hog.kill()
                hog.join()
        for name, lines in governor_lines.items():
            if lines:
                note(f"{host} host, {name}, the daemon's log: {lines}")
        best = min(wall for name, wall in walls.items() if name != "default")
        note(f"{host} host: default / best fixed -t {walls['default'] / best:.2f}x")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    note(f"client CPU: {usage.ru_utime + usage.ru_stime:.1f} s")

