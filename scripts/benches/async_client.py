"""The AsyncClient's own CPU per request: the cost of its pump (socket, ring, waking the
waiting coroutines), which an HTTP server process pays for every request it relays.

    .venv/bin/python scripts/bench.py async_client [--model /tmp/tiny.gguf] [--requests 1024]

One daemon (tiny model, --parallel 64, one compute thread); 64 coroutines share one
AsyncClient and send their share of --requests in turn, once to warm up and once timed,
for each --max-tokens. Prints a row per --max-tokens: the CPU of this process (the client
alone) per request and per token, and the requests a second.
"""

import asyncio
import resource
import time
from pathlib import Path

from tiny_models.llama import make_tiny_model

from benches.options import bench_parser
from benches.peers import CbatchDaemon
from benches.report import Table, note
from cbatch.client import AsyncClient

NUM_COROUTINES = 64


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def timed_round(endpoint: str, num_requests: int, max_tokens: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of the timed round, after one round to warm up."""
    async with await AsyncClient.connect(endpoint) as client:
        async def caller(i: int) -> None:
            for _ in range(num_requests // NUM_COROUTINES):
                await client.generate(prompt=f"caller {i}", max_tokens=max_tokens, temperature=0, ignore_eos=True)

        await asyncio.gather(*(caller(i) for i in range(NUM_COROUTINES)))
        cpu_started, started = own_cpu_s(), time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(NUM_COROUTINES)))
        return own_cpu_s() - cpu_started, time.perf_counter() - started


def main() -> None:
    parser = bench_parser(__doc__, model=None, requests=1024, max_tokens=[1, 16])
    parser.add_argument("--model", default="/tmp/tiny.gguf", help="GGUF (written as the tiny test model if missing)")
    args = parser.parse_args()
    if args.requests < NUM_COROUTINES:
        parser.error(f"--requests must be at least {NUM_COROUTINES}, one for each coroutine")
    if not Path(args.model).exists():
        make_tiny_model(args.model)
    num_requests = args.requests // NUM_COROUTINES * NUM_COROUTINES
    daemon = CbatchDaemon(args.model, NUM_COROUTINES, ["-c", str(NUM_COROUTINES * 256), "-t", "1"])
    note(f"{num_requests} requests from {NUM_COROUTINES} coroutines sharing one AsyncClient; one daemon, "
         f"--parallel {NUM_COROUTINES}, one compute thread")
    figures = Table("The AsyncClient's own CPU, the timed round", "max_tokens", "CPU us/request", "CPU us/token",
                    "requests/s")
    try:
        for max_tokens in args.max_tokens:
            cpu_s, wall_s = asyncio.run(timed_round(daemon.endpoint, num_requests, max_tokens))
            figures.row(max_tokens, 1e6 * cpu_s / num_requests, 1e6 * cpu_s / num_requests / max_tokens,
                        num_requests / wall_s)
    finally:
        daemon.stop()

