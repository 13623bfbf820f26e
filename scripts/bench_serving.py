"""Every way of reaching cbatch beside the physical limit and llama-server, in one run, at
each --parallel level: a closed loop of --clients callers (short prompts, greedy with
ignore_eos, --max-tokens each), measured as generated tok/s through

    bare llama_decode   steps of --parallel sequences of the same shapes (the prompts'
                        length, then one token each), through the engine's runner with no
                        scheduling, sampling, sockets or ring: the limit of this machine
    one Client's batch  generate_batch(max_in_flight=--clients)
    threads             --clients threads, a Client each (a threaded web app)
    AsyncClient         --clients coroutines sharing one AsyncClient (an asyncio web app)
    HTTP                /v1/completions, whole responses and streamed (TTFT, ITL)
    llama-server        the same over its HTTP, whole and streamed (--llama-server PATH)

with each path's ratio to llama-server (whole against whole, streamed against streamed)
and to bare decode. Every caller is a thread or coroutine of this process, sharing the
cores with the server as on one host; one daemon per level, started with --http.

    .venv/bin/python scripts/make_tiny_model.py /tmp/tiny.gguf
    .venv/bin/python scripts/bench_serving.py --model /tmp/tiny.gguf --parallel 16 64 \
        [--llama-server build/llama-server/bin/llama-server]
"""

import argparse
import asyncio
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_step import bare_decode  # noqa: E402
from bench_http import closed_loop, http_sender, one_client_batch, percentiles, prompts, wait_http, zmq_sender  # noqa: E402
from bench_long_prompts import CbatchDaemon, LlamaServer  # noqa: E402
import bench_long_prompts  # noqa: E402

from cbatch.client import AsyncClient, Client  # noqa: E402
from cbatch.model import resolve_model_path  # noqa: E402

CTX_PER_SEQ = 1024
BARE = "bare llama_decode"
SERVER_WHOLE, SERVER_STREAMED = "llama-server, HTTP whole", "llama-server, HTTP streamed"


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


def http_pair(url: str, work: list[str], args, model: str, rows: dict, latencies: dict, name: str,
              streamed_name: str) -> None:
    """Whole responses, then streamed with TTFT and ITL, into rows and latencies."""
    num_clients = args.clients
    closed_loop(work[:num_clients], num_clients, http_sender(url, 8, model, False))  # warm-up
    rows[name] = closed_loop(work, num_clients, http_sender(url, args.max_tokens, model, False))[0]
    rows[streamed_name], ttfts, itls = closed_loop(work, num_clients, http_sender(url, args.max_tokens, model, True))
    latencies[streamed_name] = f"TTFT {percentiles(ttfts)}; ITL {percentiles(itls)}"


def measure_level(model_path: str, parallel: int, args, work: list[str]) -> tuple[dict, dict, int]:
    """(path -> tok/s, streamed path -> latency percentiles, prompt tokens) at one level."""
    rows, latencies, model = {}, {}, Path(model_path).name
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    daemon = CbatchDaemon(model_path, parallel, ["--http", str(port), "-c", str(CTX_PER_SEQ * parallel)])
    endpoint = daemon.endpoint
    try:
        wait_http(f"http://127.0.0.1:{port}")
        with Client(endpoint) as client:
            prompt_tokens = client.generate(prompt=work[0], max_tokens=1).usage["prompt_tokens"]
        closed_loop(work[:args.clients], args.clients, zmq_sender(endpoint, 8))  # warm-up
        rows["one Client, generate_batch"] = one_client_batch(endpoint, work, args.max_tokens, args.clients)
        rows[f"{args.clients} threads, a Client each"] = closed_loop(work, args.clients,
                                                                     zmq_sender(endpoint, args.max_tokens))[0]
        rows[f"AsyncClient, {args.clients} coroutines"] = async_callers(endpoint, work, args.max_tokens, args.clients)
        http_pair(f"http://127.0.0.1:{port}", work, args, model, rows, latencies, "cbatch HTTP whole",
                  "cbatch HTTP streamed")
    finally:
        daemon.stop()
    rows[BARE] = parallel / bare_decode(model_path, parallel, prompt_tokens, args.max_tokens, CTX_PER_SEQ)[1]
    if args.llama_server:
        server = LlamaServer(model_path, parallel, CTX_PER_SEQ, os.cpu_count(), args.clients)
        try:
            http_pair(f"http://127.0.0.1:{server.port}", work, args, model, rows, latencies, SERVER_WHOLE,
                      SERVER_STREAMED)
        finally:
            server.stop()
    return rows, latencies, prompt_tokens


def ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def print_table(levels: list[int], results: list[tuple[dict, dict, int]]) -> None:
    names = [BARE] + [name for name in results[0][0] if name != BARE]
    header = f"{'path':32}" + "".join(f"  {'--parallel ' + str(p):>28}" for p in levels)
    print(header)
    print(f"{'':32}" + f"  {'tok/s':>10} {'/server':>8} {'/bare':>8}" * len(levels))
    for name in names:
        cells = []
        for rows, _, _ in results:
            server = rows.get(SERVER_STREAMED if "streamed" in name else SERVER_WHOLE)
            cells.append(f"  {rows[name]:10.1f} {ratio(rows[name], server):>8} {ratio(rows[name], rows[BARE]):>8}")
        print(f"{name:32}" + "".join(cells))
    for parallel, (_, latencies, _) in zip(levels, results):
        for name, line in latencies.items():
            print(f"--parallel {parallel} {name}: {line}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF (default: the embedded gemma-3-270m)")
    parser.add_argument("--parallel", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--clients", type=int, default=64, help="closed-loop callers on every path")
    parser.add_argument("--requests", type=int, default=768, help="requests per path (default 64 callers x 12)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--llama-server", default="", help="a llama-server binary to compare with")
    args = parser.parse_args(argv)
    if args.llama_server:
        bench_long_prompts.LLAMA_SERVER = Path(args.llama_server)
    model_path = resolve_model_path(args.model)
    work = prompts(args.requests)
    results = [measure_level(model_path, parallel, args, work) for parallel in args.parallel]
    print(f"model {Path(model_path).name}; {args.requests} requests x {args.max_tokens} tokens (greedy, ignore_eos), "
          f"{args.clients} closed-loop callers per path, {results[0][2]}-token prompts; generated tok/s, "
          "and the ratio to llama-server (/server) and to bare decode (/bare)")
    print_table(args.parallel, results)


if __name__ == "__main__":
    main()
