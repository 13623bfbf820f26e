"""Daemons behind the smg router on this machine: what the router costs, what a second
daemon adds, and what prefix-aware routing buys (docs/scale-out.md has the figures).

    .venv/bin/python scripts/bench.py scale_out [--model PATH] [--requests N] [--max-tokens N]

1. one daemon pinned to CPU 0 with --threads 1, reached directly, then through the router;
2. two daemons pinned to CPUs 0 and 1 (their --threads default follows the affinity mask:
   one each) behind the router, against 1's direct figure;
3. several shared prefixes (~600 tokens each) with many questions each, through the router
   with cache_aware and with round_robin (fresh daemons for each): the prefix-cache hit
   rate (prompt tokens the daemons did not compute) and the throughput.
Each load is `--concurrency` callers per daemon sending non-streamed completions. Prints a
row per load (its tok/s, tokens, time, failures, and the hit rate in 3) and the ratios
between them as notes.
"""

import asyncio
import os
import sys
import time

import httpx
from scale_out import ScaleOut, free_port

from benches.options import bench_parser
from benches.report import Table, note

WORDS = ("river", "stone", "lamp", "orchard", "signal", "harbor", "copper", "meadow", "ledger", "falcon")


def prefix_text(index: int, num_words: int) -> str:
    """A document of its own per index: about 4 tokens a word for the default model."""
    body = " ".join(f"{WORDS[(index * 7 + i) % len(WORDS)]}{(index * 131 + i * 17) % 997}" for i in range(num_words))
    return f"Document {index}. {body}\n\n"


async def run_load(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Every prompt once, `concurrency` at a time: completion tokens per second of wall time."""
    queue = list(reversed(prompts))
    totals = {"completion_tokens": 0, "prompt_tokens": 0, "failed": 0}

    async def caller(http: httpx.AsyncClient) -> None:
        while queue:
            body = {"model": model, "prompt": queue.pop(), "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            reply = await http.post(f"{base_url}/v1/completions", json=body)
            if reply.status_code != 200:
                totals["failed"] += 1
                totals.setdefault("first_failure", f"{reply.status_code} {reply.text[:300]}")
                continue
            usage = reply.json()["usage"]
            totals["completion_tokens"] += usage["completion_tokens"]
            totals["prompt_tokens"] += usage["prompt_tokens"]

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
        await asyncio.gather(*(caller(http) for _ in range(concurrency)))
    elapsed_s = time.monotonic() - started
    return {**totals, "elapsed_s": elapsed_s, "tok_per_s": totals["completion_tokens"] / elapsed_s}


def model_of(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def daemon_counter(daemon_urls: list[str], name: str) -> float:
    """One of cbatch's counters, summed over the daemons' metrics."""
    total = 0.0
    for url in daemon_urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.split(" ")[0] in (name, f"{name}_total"):
                total += float(line.split()[1])
    return total


def prefix_hit_rate(daemon_urls: list[str]) -> float:
    """Of the prompt tokens the daemons served, the share their prefix caches held."""
    reused = daemon_counter(daemon_urls, "cbatch_prompt_tokens_reused")
    return reused / max(reused + daemon_counter(daemon_urls, "cbatch_prompt_tokens_computed"), 1.0)


def measure(base_url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    return asyncio.run(run_load(base_url, model_of(base_url), prompts, concurrency, max_tokens))


def with_daemons(cpus: list[set[int]], worker_args: list[str], run) -> object:
    """Start a daemon per CPU set (each on a port free when it starts; the router takes
    --port), call run(scale_out), stop everything whatever happens."""
    scale_out = ScaleOut()
    try:
        for cpu_set in cpus:
            scale_out.start_daemon(free_port(), worker_args, cpu_set)
        return run(scale_out)
    finally:
        scale_out.stop()


def main() -> None:
    parser = bench_parser(__doc__, requests=(48, "requests per daemon in 1 and 2 (default 48)"),
                          max_tokens=(64, "tokens per request (default 64)"))
    parser.add_argument("--concurrency", type=int, default=8, help="callers per daemon (default 8)")
    parser.add_argument("--prefixes", type=int, default=4, help="shared prefixes in 3 (default 4)")
    parser.add_argument("--questions", type=int, default=8, help="questions per prefix in 3 (default 8)")
    parser.add_argument("--prefix-words", type=int, default=150,
                        help="words per prefix in 3 (default 150: about 600 tokens of the default model)")
    parser.add_argument("--port", type=int, default=18400, help="the router's port; daemons take the next ones")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("bench.py scale_out: needs 2 CPUs")
    common = [*(["--model", args.model] if args.model else []), "--parallel", str(args.concurrency)]
    pinned = [{cpus[0]}, {cpus[1]}]
    questions = [f"Question {i}: what comes after {i}?" for i in range(2 * args.requests)]
    note(f"CPUs {cpus[0]} and {cpus[1]}; {args.concurrency} callers per daemon, {args.max_tokens} tokens a request; "
         f"1. one daemon pinned to one CPU, --threads 1; 2. two daemons pinned to a CPU each, default --threads; "
         f"3. {args.prefixes} shared {args.prefix_words}-word prefixes x {args.questions} questions, two daemons")
    loads = Table("Completion tokens per second of each load", "load", "tok/s", "tokens", "wall s", "failed",
                  "prompt tokens", "prefix hits %", widths={"load": 27})
    first_failures = []

    def add(label: str, result: dict) -> None:
        loads.row(label, result["tok_per_s"], result["completion_tokens"], result["elapsed_s"], result["failed"],
                  result["prompt_tokens"], 100 * result["hit_rate"] if "hit_rate" in result else None)
        if result["failed"]:
            first_failures.append(f"{label}, the first failure: {result['first_failure']}")

    def one(scale_out: ScaleOut) -> tuple[dict, dict]:
        direct = measure(scale_out.daemon_urls[0], questions[:args.requests], args.concurrency, args.max_tokens)
        add("1. one daemon, direct", direct)
        scale_out.start_router(args.port, "cache_aware")
        routed = measure(scale_out.router_url, questions[:args.requests], args.concurrency, args.max_tokens)
        add("1. one daemon, through smg", routed)
        return direct, routed

    direct, routed = with_daemons(pinned[:1], [*common, "--threads", "1"], one)

    def two(scale_out: ScaleOut) -> dict:
        scale_out.start_router(args.port, "cache_aware")
        return measure(scale_out.router_url, questions, 2 * args.concurrency, args.max_tokens)

    both = with_daemons(pinned, common, two)
    add("2. two daemons, through smg", both)

    prompts = [prefix_text(p, args.prefix_words) + f"Question {q}: what is item {q}?" for q in range(args.questions)
               for p in range(args.prefixes)]
    by_policy = {}
    for policy in ("cache_aware", "round_robin"):
        def shared_prefixes(scale_out: ScaleOut, policy=policy) -> dict:
            scale_out.start_router(args.port, policy)
            result = measure(scale_out.router_url, prompts, 2 * args.concurrency, args.max_tokens)
            time.sleep(0.5)  # the daemons' stats reach their metrics every quarter second
            result["hit_rate"] = prefix_hit_rate(scale_out.daemon_urls)
            return result

        by_policy[policy] = with_daemons(pinned, common, shared_prefixes)
        add(f"3. prefixes, {policy}", by_policy[policy])
    ratio = by_policy["cache_aware"]["tok_per_s"] / max(by_policy["round_robin"]["tok_per_s"], 1e-9)
    note(f"through the router / direct: {routed['tok_per_s'] / direct['tok_per_s']:.2f}")
    note(f"two daemons / one direct: {both['tok_per_s'] / direct['tok_per_s']:.2f}")
    note(f"cache_aware / round_robin: {ratio:.2f}")
    for failure in first_failures:
        note(failure)
