"""Generated tokens/s through the OpenAI HTTP endpoint vs the ZeroMQ Client, in one run
against one daemon (and vs llama-server over HTTP when a binary is given), closed loop
with short prompts: tok/s with whole responses, then the same streamed for time to first
token and inter-token latency (and streamed tok/s), each path both ways.

    .venv/bin/python scripts/bench.py http_vs_zmq --parallel 16 --requests 64 --max-tokens 64 \
        [--llama-server /path/to/llama-server]

Every client is a thread of this process, so the load generator shares the machine's
cores with the server, as it would on one host. The HTTP server's own CPU time is read
from /proc for its run.
"""

import argparse
import json
import os
import socket
import time
from pathlib import Path

import httpx
import numpy as np

from benches import long_prompts, peers
from benches.peers import CbatchDaemon, LlamaServer, http_pid, wait_http
from benches.proc_cpu import process_cpu_s
from cbatch.client import Client
from cbatch.model import resolve_model_path


def prompts(count: int) -> list[str]:
    return [f"Note {i}: write a few words about the number {i * 7}." for i in range(count)]


def closed_loop(all_prompts: list[str], num_clients: int, make_send) -> tuple[float, list[float], list[float]]:
    """Each client thread sends its share one after another; tokens/s, TTFTs and ITLs (s)."""
    counts, ttfts, itls = [0] * num_clients, [], []

    def loop(i):
        send = make_send()
        for prompt in all_prompts[i::num_clients]:
            num_tokens, ttft, gaps = send(prompt)
            counts[i] += num_tokens
            if ttft is not None:
                ttfts.append(ttft)
                itls.extend(gaps)

    elapsed_s = long_prompts.run_clients(num_clients, loop)
    return sum(counts) / elapsed_s, ttfts, itls


def zmq_sender(endpoint: str, max_tokens: int, is_stream: bool = False):
    """Client.generate; streamed (Client.stream), a token's time is when its chunk arrives."""
    def make():
        client = Client(endpoint)

        def send(prompt):
            params = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            if not is_stream:
                return client.generate(**params).usage["completion_tokens"], None, []
            started, arrivals, num_tokens = time.perf_counter(), [], 0
            for chunk in client.stream(**params):
                if chunk.token_ids:
                    arrivals.append(time.perf_counter())
                    num_tokens += len(chunk.token_ids)
            return num_tokens, (arrivals[0] - started) if arrivals else None, list(np.diff(arrivals))

        return send

    return make


def one_client_batch(endpoint: str, work: list[str], max_tokens: int, max_in_flight: int) -> float:
    """tok/s of the whole workload through one Client's generate_batch (whole responses)."""
    items = [{"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for prompt in work]
    with Client(endpoint) as client:
        started = time.perf_counter()
        results = client.generate_batch(items, max_in_flight=max_in_flight)
        elapsed_s = time.perf_counter() - started
    return sum(r.usage["completion_tokens"] for r in results) / elapsed_s


def http_sender(base_url: str, max_tokens: int, model: str, is_stream: bool, timeout_s: float = 600.0):
    """/v1/completions; streamed, a token's time is when its SSE event arrives."""
    def make():
        http = httpx.Client(timeout=timeout_s)

        def send(prompt):
            try:
                return send_once(prompt)
            except httpx.RemoteProtocolError:  # a kept-alive connection the server had closed: resend once
                return send_once(prompt)

        def send_once(prompt):
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": is_stream, "stream_options": {"include_usage": True}}
            if not is_stream:
                reply = http.post(f"{base_url}/v1/completions", json=body)
                reply.raise_for_status()
                return reply.json()["usage"]["completion_tokens"], None, []
            started = time.perf_counter()
            arrivals, usage = [], None
            with http.stream("POST", f"{base_url}/v1/completions", json=body) as reply:
                reply.raise_for_status()
                for line in reply.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    if event["choices"] and event["choices"][0].get("text"):
                        arrivals.append(time.perf_counter())
            gaps = list(np.diff(arrivals)) if arrivals else []
            return usage["completion_tokens"], (arrivals[0] - started) if arrivals else None, gaps

        return send

    return make


def http_runs(url: str, work: list[str], args, model: str) -> tuple[float, float, list[float], list[float]]:
    """Whole responses for tok/s, then the same streamed for TTFT and ITL."""
    closed_loop(work[:args.parallel], args.parallel, http_sender(url, 8, model, False))  # warm-up
    whole_tps, _, _ = closed_loop(work, args.parallel, http_sender(url, args.max_tokens, model, False))
    stream_tps, ttfts, itls = closed_loop(work, args.parallel, http_sender(url, args.max_tokens, model, True))
    return whole_tps, stream_tps, ttfts, itls


def percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    p50, p90, p99 = np.percentile(np.array(values) * 1000, [50, 90, 99])
    return f"p50 {p50:.1f} ms, p90 {p90:.1f} ms, p99 {p99:.1f} ms"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF (default: the embedded gemma-3-270m)")
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    parser.add_argument("--llama-server", default="", help="a llama-server binary to compare with")
    args = parser.parse_args(argv)
    if not args.port:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]
    model_path = resolve_model_path(args.model)
    model = Path(model_path).name
    work = prompts(args.requests)
    daemon = CbatchDaemon(model_path, args.parallel, ["--http", str(args.port), "-c", str(1024 * args.parallel)])
    base_url = f"http://127.0.0.1:{args.port}"
    try:
        wait_http(base_url)
        closed_loop(work[:args.parallel], args.parallel, zmq_sender(daemon.endpoint, 8))  # warm-up
        batch_tps = one_client_batch(daemon.endpoint, work, args.max_tokens, args.parallel)
        zmq_tps, _, _ = closed_loop(work, args.parallel, zmq_sender(daemon.endpoint, args.max_tokens))
        zmq_stream_tps, zmq_ttfts, zmq_itls = closed_loop(work, args.parallel,
                                                          zmq_sender(daemon.endpoint, args.max_tokens, True))
        pid = http_pid(daemon)
        cpu_before, started = process_cpu_s(pid), time.perf_counter()
        http_tps, stream_tps, ttfts, itls = http_runs(base_url, work, args, model)
        http_cpu = (process_cpu_s(pid) - cpu_before) / (time.perf_counter() - started)
    finally:
        daemon.stop()
    print(f"model {model}, parallel {args.parallel}, {args.requests} requests x {args.max_tokens} tokens, "
          f"{args.parallel} closed-loop clients")
    print(f"one Client, generate_batch: {batch_tps:8.1f} tok/s whole responses")
    print(f"ZeroMQ Client:   {zmq_tps:8.1f} tok/s whole responses; {zmq_stream_tps:.1f} tok/s streamed "
          f"({args.parallel} threads, a Client each)")
    print(f"  streamed: TTFT {percentiles(zmq_ttfts)}")
    print(f"  streamed: ITL  {percentiles(zmq_itls)}")
    print(f"HTTP (cbatch):   {http_tps:8.1f} tok/s whole responses = {http_tps / zmq_tps:.2f} of ZeroMQ; "
          f"{stream_tps:.1f} tok/s streamed = {stream_tps / zmq_stream_tps:.2f} of ZeroMQ streamed; "
          f"HTTP server process CPU {100 * http_cpu:.0f}% of one core")
    print(f"  streamed: TTFT {percentiles(ttfts)}")
    print(f"  streamed: ITL  {percentiles(itls)}")
    if args.llama_server:
        peers.LLAMA_SERVER = Path(args.llama_server)
        server = LlamaServer(model_path, args.parallel, 1024, os.cpu_count())
        try:
            ls_tps, ls_stream_tps, ls_ttfts, ls_itls = http_runs(f"http://127.0.0.1:{server.port}", work, args, model)
        finally:
            server.stop()
        print(f"llama-server:    {ls_tps:8.1f} tok/s whole responses; {ls_stream_tps:.1f} tok/s streamed; "
              f"cbatch HTTP / llama-server = {http_tps / ls_tps:.2f} whole, {stream_tps / ls_stream_tps:.2f} streamed")
        print(f"  vs llama-server whole: one Client's batch {batch_tps / ls_tps:.2f}, "
              f"threads with a Client each {zmq_tps / ls_tps:.2f}, HTTP {http_tps / ls_tps:.2f}")
        print(f"  streamed: TTFT {percentiles(ls_ttfts)}")
        print(f"  streamed: ITL  {percentiles(ls_itls)}")

