"""The callers a benchmark runs in its own process: a closed loop of client threads, each
sending its share of the prompts one after another through a sender (the ZeroMQ Client,
streamed or whole; /v1/completions over HTTP, streamed or whole), and one Client's batch.
A sender returns (tokens generated, time to first token or None, the gaps between tokens).
The separate, lighter HTTP load generator is loadgen.py, a process of its own."""

import json
import threading
import time

import httpx
import numpy as np

from cbatch.client import Client


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

    elapsed_s = run_clients(num_clients, loop)
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


def run_clients(num_clients: int, client_loop) -> float:
    """Run client_loop(i) on num_clients threads at once; seconds until all are done. The
    first exception a client raised is raised here, after the run."""
    errors: list[BaseException] = []

    def guarded(i):
        try:
            client_loop(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(num_clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def counted(send):
    """A sender of whole responses from a function that returns only the tokens generated."""
    return lambda: lambda prompt: (send(prompt), None, [])


def percentiles_ms(seconds: list[float]) -> list[float | None]:
    """p50, p90 and p99 of these times, in milliseconds (None each when there are none)."""
    if not seconds:
        return [None] * 3
    return [float(ms) for ms in np.percentile(np.array(seconds) * 1000, [50, 90, 99])]
