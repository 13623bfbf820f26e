"""Embeddings never stall a stream and are never computed for nobody, on the default model
(gemma-3-270m: its 262k-wide vocabulary makes an embedding token cost about as much as a
whole generation step on a CPU, where the tiny model would hide a stall)."""

import threading
import time

import httpx
import numpy as np
import pytest
from daemonkit import serve_module
from httpkit import HttpDaemon

INPUTS = [f"sentence number {i} about the weather today" for i in range(128)]


@pytest.fixture(scope="module")
def daemon(gemma_model_path):
    yield from serve_module(HttpDaemon(gemma_model_path, "--parallel", "2", "--ctx-size", "2048"))


def test_a_stream_keeps_its_pace_beside_a_large_embedding_request(daemon):
    """The embedding work beside a stream is cut into decodes of about a step's time, so the
    stream's worst gap while it runs stays a small multiple of its median gap."""
    arrivals, embedded = [], []
    with daemon.client() as client, daemon.client() as embedder:
        stream = client.stream("Once upon a time", max_tokens=200, ignore_eos=True, temperature=0)
        arrivals.append(time.monotonic())
        next(stream)
        worker = threading.Thread(target=lambda: embedded.append(embedder.embed(INPUTS)))
        worker.start()
        for chunk in stream:
            arrivals.append(time.monotonic())
            if not worker.is_alive():
                break
        worker.join()
        stream.close()
    assert len(embedded) == 1 and len(embedded[0]) == len(INPUTS)
    gaps = np.diff(arrivals[1:])
    assert len(gaps) >= 10  # the embeddings ran beside many of its steps
    assert gaps.max() < 10 * np.median(gaps), (gaps.max(), np.median(gaps))


def test_an_embedding_request_whose_caller_hung_up_is_not_computed(daemon):
    """A caller that gives up on a long embedding request cancels it: a one-input request
    sent after it is answered without waiting for the rest, and the worker embedded far
    fewer inputs than were asked."""
    with daemon.client() as client:
        before = client.stats()["num_embedding_inputs"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{daemon.base_url}/v1/embeddings", json={"input": INPUTS * 2}, timeout=1.5)
    with daemon.client() as client:
        assert len(client.embed(["after the hang-up"])) == 1
        # Embedded in order, so the request after it ran once the abandoned one stopped.
        done = client.stats()["num_embedding_inputs"] - before
    assert done < len(INPUTS), done
