"""The latency histograms of /metrics against latencies measured by a caller: a request
that waits for the only slot has a time to first token as long as its wait, and the
histogram says so, never more than the callers measured (it once read the clock before
awaiting the first tokens, so every request's first token seemed to come as it arrived)."""

import threading
import time

import httpx
import pytest
from daemonkit import serve_module
from httpkit import HttpDaemon

TTFT_SUM = ("cbatch_http_time_to_first_token_seconds_sum", ())
TTFT_COUNT = ("cbatch_http_time_to_first_token_seconds_count", ())
MIN_WAIT_S = 0.3  # the queued request's measured wait must be at least this for the test to say anything


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    # One compute thread: the holder's 2000 tokens take seconds, not minutes, on a busy
    # machine (two threads spin at their barrier when another process takes a core).
    yield from serve_module(HttpDaemon(tiny_model_path, "--parallel", "1", "--ctx-size", "4096", "--threads", "1"))


def _streamed_ttft_s(base_url: str, body: dict) -> float:
    """A streamed completion read to its end: seconds from sending it to its first token."""
    sent_s = time.monotonic()
    with httpx.stream("POST", f"{base_url}/v1/completions", timeout=300, json={**body, "stream": True}) as reply:
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        ttft_s = time.monotonic() - sent_s
        list(lines)
    return ttft_s


def test_time_to_first_token_counts_the_wait_for_a_slot(daemon):
    before = daemon.metrics()
    holder_ttft_s = []
    body = {"prompt": "hold the slot", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    holder = threading.Thread(target=lambda: holder_ttft_s.append(_streamed_ttft_s(daemon.base_url, body)),
                              daemon=True)
    holder.start()
    with daemon.client() as client:  # the holder runs before the measured request is sent
        deadline = time.monotonic() + 60
        while client.stats()["num_active"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    measured_s = _streamed_ttft_s(daemon.base_url, {"prompt": "wait for it", "max_tokens": 4})
    holder.join(300)
    after = daemon.metrics()
    assert after[TTFT_COUNT] - before.get(TTFT_COUNT, 0) == 2
    assert measured_s >= MIN_WAIT_S, "the holder ended too soon to measure a wait: raise its max_tokens"
    # The two requests' first-token times: the holder's (short) and the waiter's (its wait).
    # The server times each from the request's arrival to its first token's, inside what
    # the caller measured from sending it to reading that token.
    observed_s = after[TTFT_SUM] - before.get(TTFT_SUM, 0)
    assert 0.8 * measured_s <= observed_s <= holder_ttft_s[0] + measured_s, (observed_s, holder_ttft_s, measured_s)
