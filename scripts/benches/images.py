"""Image requests beside text streams: what an image costs the streams that run beside it.

--streams text streams (streamed /v1/completions, --max-tokens each, greedy, ignore_eos)
run alone, then again while image chat requests are sent --image-callers at a time, each
with an image never sent before (so each is decoded and encoded), and again with text
requests as long in their place. Printed, a row per run: the streams' median, p99 and
worst gap between two token events, and the load's requests with their time to first
token (p50 and worst); then a row each for 8 concurrent requests with one same new image
and for 8 with a new image each: their time, and the vision encoder's runs (the worker's
`num_images_encoded`), once for the shared image. The benchmark's own process CPU is
noted beside, since on a small machine it shares the cores with the daemon.

    .venv/bin/python scripts/make_tiny_model.py /tmp/tiny-chat.gguf --chat-template scripts/chatml_tools.jinja
    .venv/bin/python scripts/make_tiny_model.py --kind projector /tmp/tiny-projector.gguf
    .venv/bin/python scripts/bench.py images --model /tmp/tiny-chat.gguf --mmproj /tmp/tiny-projector.gguf
"""

import concurrent.futures
import json
import resource
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benches.callers import http_sender
from benches.options import REQUIRED, bench_parser
from benches.peers import CbatchDaemon, wait_http
from benches.report import Table, note
from cbatch.client import Client
from cbatch.workers.decode.publisher import STATS_INTERVAL_S

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from imagekit import image_part, png_bytes  # noqa: E402  (the tests' helpers)

IMAGE_SIDE = 64  # pixels: the tiny projector pads every image to its own 32 x 32


def image_ttft_s(http: httpx.Client, model: str, image: bytes | None) -> float:
    """Seconds from sending a streamed chat request with `image` to its first content event;
    without an image, text of about as many tokens in its place."""
    picture = image_part(image) if image is not None else {"type": "text", "text": " a picture" * 16}
    body = {"model": model, "max_tokens": 4, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                                      picture]}]}
    started = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    return time.perf_counter() - started
    return time.perf_counter() - started  # an answer with no text: its end


def streams_gaps(url: str, model: str, args, load: str = "") -> tuple[list[float], list[float]]:
    """(every gap in ms of the text streams, every TTFT in ms of the load's requests sent
    meanwhile); `load` "images" (a new one each), "text" (as long, no image) or "" (none)."""
    ttfts, is_running, seed = [], threading.Event(), iter(range(10 ** 9))
    is_running.set()

    def send_load() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while is_running.is_set():
                image = png_bytes(IMAGE_SIDE, IMAGE_SIDE, next(seed)) if load == "images" else None
                ttfts.append(image_ttft_s(http, model, image) * 1000)

    loaders = [threading.Thread(target=send_load) for _ in range(args.image_callers if load else 0)]
    for loader in loaders:
        loader.start()
    with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
        sends = [pool.submit(http_sender(url, args.max_tokens, model, True)(), "Tell me a long story.")
                 for _ in range(args.streams)]
        gaps = [gap * 1000 for send in sends for gap in send.result()[2]]
    is_running.clear()
    for loader in loaders:
        loader.join()
    return gaps, ttfts


def concurrent_images(daemon, url: str, model: str, images: list[bytes]) -> tuple[float, int]:
    """(seconds, vision encoder runs) for one concurrent request per image."""
    time.sleep(2 * STATS_INTERVAL_S)  # the worker's stats lag its work by up to this: the last phase's images too
    with Client(daemon.endpoint) as client:
        encoded_before = client.stats()["num_images_encoded"]
    clients = [httpx.Client(base_url=url, timeout=600) for _ in images]
    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        started = time.perf_counter()
        list(pool.map(lambda pair: image_ttft_s(pair[0], model, pair[1]), zip(clients, images)))
        elapsed_s = time.perf_counter() - started
    for http in clients:
        http.close()
    time.sleep(2 * STATS_INTERVAL_S)  # the worker's stats lag its work by up to this
    with Client(daemon.endpoint) as client:
        return elapsed_s, client.stats()["num_images_encoded"] - encoded_before


def main(argv=None) -> None:
    parser = bench_parser(__doc__, model=REQUIRED, parallel=8, max_tokens=(400, "tokens per text stream"))
    parser.add_argument("--mmproj", required=True, help="its vision projector GGUF")
    parser.add_argument("--streams", type=int, default=3, help="text streams")
    parser.add_argument("--image-callers", type=int, default=2, help="closed-loop callers sending images")
    args = parser.parse_args(argv)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    daemon = CbatchDaemon(args.model, args.parallel, ["--http", str(port), "--mmproj", args.mmproj,
                                                      "-c", str(1024 * args.parallel)])
    url, model = f"http://127.0.0.1:{port}", Path(args.model).name
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        wait_http(url)
        with httpx.Client(base_url=url, timeout=600) as http:
            image_ttft_s(http, model, png_bytes(IMAGE_SIDE, IMAGE_SIDE, -1))  # warm-up
        runs = {"alone": streams_gaps(url, model, args)}
        for load in ("text", "images"):
            runs[f"beside {args.image_callers} callers sending {load}"] = streams_gaps(url, model, args, load)
        shared = concurrent_images(daemon, url, model, [png_bytes(IMAGE_SIDE, IMAGE_SIDE, -2)] * 8)
        distinct = concurrent_images(daemon, url, model, [png_bytes(IMAGE_SIDE, IMAGE_SIDE, -3 - i) for i in range(8)])
    finally:
        daemon.stop()
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    note(f"model {model} with {Path(args.mmproj).name}, --parallel {args.parallel}; {args.streams} text streams of "
         f"{args.max_tokens} tokens; images {IMAGE_SIDE}x{IMAGE_SIDE} PNG, each new")
    streams = Table("Text streams' gaps between token events, alone and beside each load", "run", "gap p50 ms",
                    "gap p99 ms", "worst gap ms", "load requests", "load TTFT p50 ms", "load worst TTFT ms",
                    widths={"run": max(len(name) for name in runs)})
    for name, (gaps, ttfts) in runs.items():
        streams.row(name, float(np.median(gaps)), float(np.percentile(gaps, 99)), max(gaps), len(ttfts),
                    float(np.median(ttfts)) if ttfts else None, max(ttfts) if ttfts else None)
    concurrent = Table("8 concurrent requests with images", "images", "wall ms", "encoder runs", widths={"images": 18})
    for name, (elapsed_s, num_encoded) in (("one same new image", shared), ("8 new images", distinct)):
        concurrent.row(name, elapsed_s * 1000, num_encoded)
    note(f"benchmark process CPU: {cpu_s:.1f} s")
