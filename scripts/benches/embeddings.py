"""Embeddings per second, cbatch against llama-server on the same model, and what an
embedding load does to a generation stream beside it.

For each --batch-sizes level (inputs per request), --clients closed-loop callers send
--requests requests each of that many short texts to

    cbatch HTTP         POST /v1/embeddings of a `cbatch-worker --http` daemon
    cbatch Client       Client.embed over ZeroMQ (a thread and a Client per caller)
    llama-server        POST /v1/embeddings of `llama-server --embeddings --pooling mean`

and the inputs embedded per second are printed, a row per path and size, with cbatch's
ratio to llama-server. Then, on each server, one streamed completion (--max-tokens,
greedy, ignore_eos) runs alone and again beside an embedding load (--parallel - 1 callers
sending batches of the largest size, so that llama-server, which serves completions and
embeddings from one set of --parallel slots, keeps a slot for the stream): the worst gap
between two of its token events, and the median, is printed for both (none, and a note,
for a stream starved of tokens).

    .venv/bin/python scripts/make_tiny_model.py /tmp/tiny.gguf
    .venv/bin/python scripts/bench.py embeddings --model /tmp/tiny.gguf \\
        [--llama-server build/llama-server/bin/llama-server]
"""

import os
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benches import peers
from benches.callers import closed_loop, http_sender, prompts
from benches.options import bench_parser
from benches.peers import CbatchDaemon, LlamaServer, wait_http
from benches.report import Table, note
from cbatch.client import Client
from cbatch.model import resolve_model_path

CTX_PER_SEQ = 1024
STREAM_TIMEOUT_S = 60.0
SERVER = "llama-server HTTP"


def http_embedder(base_url: str, model: str, batch_size: int):
    def make():
        http = httpx.Client(timeout=600)

        def send(texts: list[str]) -> int:
            reply = http.post(f"{base_url}/v1/embeddings", json={"model": model, "input": texts[:batch_size]})
            reply.raise_for_status()
            return len(reply.json()["data"])

        return send

    return make


def zmq_embedder(endpoint: str, batch_size: int):
    def make():
        client = Client(endpoint)
        return lambda texts: len(client.embed(texts[:batch_size]))

    return make


def inputs_per_s(make_send, num_clients: int, num_requests: int, batch_size: int) -> float:
    """Inputs embedded per second by num_clients threads sending num_requests each."""
    texts = prompts(batch_size)

    def make_counted_send():
        send = make_send()
        return lambda _: (send(texts), None, [])

    return closed_loop([""] * (num_clients * num_requests), num_clients, make_counted_send)[0]


def token_gaps(base_url: str, model: str, max_tokens: int, make_load=None,
               num_loaders: int = 0) -> tuple[float, float] | None:
    """(worst, median) gap in ms between a streamed completion's token events, with
    num_loaders threads calling make_load()'s sender in a loop beside it when given;
    None when the stream got nothing for STREAM_TIMEOUT_S."""
    is_running, loaders = threading.Event(), []
    if make_load is not None:
        is_running.set()
        texts = prompts(64)

        def load() -> None:
            send = make_load()
            while is_running.is_set():
                send(texts)

        loaders = [threading.Thread(target=load) for _ in range(num_loaders)]
        for loader in loaders:
            loader.start()
        time.sleep(0.5)  # the load is running before the stream starts
    try:
        _, _, gaps = http_sender(base_url, max_tokens, model, True, STREAM_TIMEOUT_S)()("Tell me a long story.")
    except httpx.TimeoutException:
        return None  # starved: the server let the load take every turn
    finally:
        is_running.clear()
        for loader in loaders:
            loader.join()
    if not gaps:  # the whole stream came in one event: no token waited on another
        return 0.0, 0.0
    return float(np.max(gaps)) * 1000, float(np.median(gaps)) * 1000


def measure(args, model_path: str) -> tuple[dict, dict]:
    """(path -> {batch size -> inputs/s}, server -> ((worst, median) alone, (worst, median) under load))."""
    rates: dict[str, dict[int, float]] = {"cbatch HTTP": {}, "cbatch Client": {}, SERVER: {}}
    gaps = {}
    model = Path(model_path).name
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    daemon = CbatchDaemon(model_path, args.parallel, ["--http", str(port), "-c", str(CTX_PER_SEQ * args.parallel)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url)
        inputs_per_s(http_embedder(url, model, 1), 1, 2, 1)  # warm-up: the embedding context is made
        for size in args.batch_sizes:
            rates["cbatch HTTP"][size] = inputs_per_s(http_embedder(url, model, size), args.clients, args.requests,
                                                      size)
            rates["cbatch Client"][size] = inputs_per_s(zmq_embedder(daemon.endpoint, size), args.clients,
                                                         args.requests, size)
        load = http_embedder(url, model, max(args.batch_sizes))
        gaps["cbatch"] = (token_gaps(url, model, args.max_tokens),
                          token_gaps(url, model, args.max_tokens, load, args.parallel - 1))
    finally:
        daemon.stop()
    if args.llama_server:
        server = LlamaServer(model_path, args.parallel, CTX_PER_SEQ, os.cpu_count(), args.clients,
                             ("--embeddings", "--pooling", "mean", "-ub", "512"))
        url = f"http://127.0.0.1:{server.port}"
        try:
            inputs_per_s(http_embedder(url, model, 1), 1, 2, 1)
            for size in args.batch_sizes:
                rates[SERVER][size] = inputs_per_s(http_embedder(url, model, size), args.clients, args.requests, size)
            load = http_embedder(url, model, max(args.batch_sizes))
            gaps["llama-server"] = (token_gaps(url, model, args.max_tokens),
                                    token_gaps(url, model, args.max_tokens, load, args.parallel - 1))
        except httpx.HTTPError as err:  # a build that cannot embed, or generate beside embeddings
            note(f"llama-server: measured no further after {err!r}; its rows stop there")
        finally:
            server.stop()
    return rates, gaps


def main(argv=None) -> None:
    parser = bench_parser(__doc__, clients=(8, "closed-loop callers"),
                          requests=(20, "requests per caller at each size"),
                          parallel=(16, "--parallel / -np of both servers"),
                          max_tokens=(128, "the streamed completion's tokens"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64], help="inputs per request")
    parser.add_argument("--llama-server", default="", help="a llama-server binary to compare with")
    args = parser.parse_args(argv)
    if args.llama_server:
        peers.LLAMA_SERVER = Path(args.llama_server)
    model_path = resolve_model_path(args.model)
    rates, gaps = measure(args, model_path)
    note(f"model {Path(model_path).name}; {args.clients} closed-loop callers x {args.requests} requests per size, "
         f"--parallel {args.parallel}; mean pooling, normalized")
    figures = Table("Inputs embedded per second, and the ratio to llama-server", "path", "inputs/request",
                    "inputs/s", "/ llama-server", widths={"path": len(SERVER)})
    for name, by_size in rates.items():
        for size, rate in by_size.items():
            server = rates[SERVER].get(size)
            figures.row(name, size, rate, rate / server if server else None)
    embedding_load = f"beside {args.parallel - 1} callers embedding batches of {max(args.batch_sizes)}"
    stream_gaps = Table(f"Gaps between the token events of a {args.max_tokens}-token stream, alone and loaded "
                        f"({embedding_load})", "server", "load", "worst gap ms", "median gap ms",
                        widths={"server": 12})
    starved = []
    for name, by_load in gaps.items():
        for load, gap in zip(("alone", "loaded"), by_load):
            stream_gaps.row(name, load, *(gap or (None, None)))
            if gap is None:
                starved.append(f"{name}, {'alone' if load == 'alone' else embedding_load}")
    for stream in starved:
        note(f"{stream}: no token within {STREAM_TIMEOUT_S:.0f} s (starved)")
