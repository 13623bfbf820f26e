"""Generated tokens/s through the OpenAI HTTP endpoint vs the ZeroMQ Client, in one run
against one daemon (and vs llama-server over HTTP when a binary is given), closed loop
with short prompts: tok/s with whole responses, then the same streamed for time to first
token and inter-token latency (and streamed tok/s), each path both ways. Prints a row per
path (one Client's batch, whole responses only) and, as notes, the setup, the HTTP
server's CPU and each path's ratio to ZeroMQ (and to llama-server).

    .venv/bin/python scripts/bench.py http_vs_zmq --parallel 16 --requests 64 --max-tokens 64 \
        [--llama-server /path/to/llama-server]

Every client is a thread of this process, so the load generator shares the machine's
cores with the server, as it would on one host. The HTTP server's own CPU time is read
from /proc for its run.
"""

import os
import socket
import time
from pathlib import Path

from benches import peers
from benches.callers import closed_loop, http_sender, one_client_batch, percentiles_ms, prompts, zmq_sender
from benches.options import bench_parser
from benches.peers import CbatchDaemon, LlamaServer, http_pid, wait_http
from benches.proc_cpu import process_cpu_s
from benches.report import Table, note
from cbatch.model import resolve_model_path


def http_runs(url: str, work: list[str], args, model: str) -> tuple[float, float, list[float], list[float]]:
    """Whole responses for tok/s, then the same streamed for TTFT and ITL."""
    closed_loop(work[:args.parallel], args.parallel, http_sender(url, 8, model, False))  # warm-up
    whole_tps, _, _ = closed_loop(work, args.parallel, http_sender(url, args.max_tokens, model, False))
    stream_tps, ttfts, itls = closed_loop(work, args.parallel, http_sender(url, args.max_tokens, model, True))
    return whole_tps, stream_tps, ttfts, itls


def main(argv=None) -> None:
    parser = bench_parser(__doc__, parallel=16, requests=64, max_tokens=64)
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
    note(f"model {model}, parallel {args.parallel}, {args.requests} requests x {args.max_tokens} tokens, "
         f"{args.parallel} closed-loop clients (ZeroMQ: {args.parallel} threads, a Client each)")
    paths = Table("Generated tokens/s, whole and streamed, and the streamed latency", "path", "whole tok/s",
                  "streamed tok/s", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms",
                  "ITL p99 ms", widths={"path": 26})
    try:
        wait_http(base_url)
        closed_loop(work[:args.parallel], args.parallel, zmq_sender(daemon.endpoint, 8))  # warm-up
        batch_tps = one_client_batch(daemon.endpoint, work, args.max_tokens, args.parallel)
        paths.row("one Client, generate_batch", batch_tps, *[None] * 7)
        zmq_tps, _, _ = closed_loop(work, args.parallel, zmq_sender(daemon.endpoint, args.max_tokens))
        zmq_stream_tps, zmq_ttfts, zmq_itls = closed_loop(work, args.parallel,
                                                          zmq_sender(daemon.endpoint, args.max_tokens, True))
        paths.row("ZeroMQ Client", zmq_tps, zmq_stream_tps, *percentiles_ms(zmq_ttfts), *percentiles_ms(zmq_itls))
        pid = http_pid(daemon)
        cpu_before, started = process_cpu_s(pid), time.perf_counter()
        http_tps, stream_tps, ttfts, itls = http_runs(base_url, work, args, model)
        http_cpu = (process_cpu_s(pid) - cpu_before) / (time.perf_counter() - started)
        paths.row("HTTP (cbatch)", http_tps, stream_tps, *percentiles_ms(ttfts), *percentiles_ms(itls))
    finally:
        daemon.stop()
    if args.llama_server:
        peers.LLAMA_SERVER = Path(args.llama_server)
        server = LlamaServer(model_path, args.parallel, 1024, os.cpu_count())
        try:
            ls_tps, ls_stream_tps, ls_ttfts, ls_itls = http_runs(f"http://127.0.0.1:{server.port}", work, args, model)
        finally:
            server.stop()
        paths.row("llama-server", ls_tps, ls_stream_tps, *percentiles_ms(ls_ttfts), *percentiles_ms(ls_itls))
    note(f"HTTP (cbatch) / ZeroMQ: {http_tps / zmq_tps:.2f} whole, {stream_tps / zmq_stream_tps:.2f} streamed; "
         f"HTTP server process CPU {100 * http_cpu:.0f}% of one core")
    if args.llama_server:
        note(f"cbatch HTTP / llama-server: {http_tps / ls_tps:.2f} whole, {stream_tps / ls_stream_tps:.2f} streamed")
        note(f"vs llama-server whole: one Client's batch {batch_tps / ls_tps:.2f}, "
             f"threads with a Client each {zmq_tps / ls_tps:.2f}, HTTP {http_tps / ls_tps:.2f}")
