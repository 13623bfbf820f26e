"""Per-token log-probabilities: the math without a model, then through a real daemon."""

import asyncio
import math

import numpy as np
import pytest
from common import GREEDY
from daemonkit import Daemon, serve_module

from cbatch.client.async_client import AsyncClient
from cbatch.errors import CbatchError
from cbatch.workers.engine.sampling.logprobs import token_logprobs


def test_token_logprobs_are_a_log_softmax_with_the_top_k_in_order():
    logits = np.array([1.0, 3.0, -2.0, 3.5, 0.0], np.float32)
    token_id, piece, logprob, top = token_logprobs(logits, 1, 3, lambda t: b"<%d>" % t)
    expected = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert token_id == 1 and piece == b"<1>" and logprob == pytest.approx(expected[1])
    assert [t for t, _, _ in top] == [3, 1, 0]
    assert [lp for _, _, lp in top] == pytest.approx(expected[[3, 1, 0]])
    assert token_logprobs(logits, 4, 0, lambda t: b"")[3] == []


@pytest.mark.parametrize("num_top", [1, 5, 20])
def test_the_sampled_top_k_search_finds_the_exact_top_k(num_top):
    from cbatch.workers.engine.sampling.logprobs import _top_ids

    rng = np.random.default_rng(num_top)
    for row in (rng.standard_normal(262_144).astype(np.float32),
                np.round(rng.standard_normal(5000), 1).astype(np.float32),  # many ties
                rng.standard_normal(30).astype(np.float32)):  # shorter than the sample stride
        assert list(_top_ids(row, num_top)) == list(np.argsort(-row, kind="stable")[:num_top])


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    yield from serve_module(Daemon(tiny_model_path, "--parallel", "4", "--ctx-size", "1024", "--batch-size", "64"))


@pytest.mark.parametrize("use_ring", [True, False])
def test_greedy_tokens_are_their_own_top_alternative(daemon, use_ring):
    with daemon.client(use_ring=use_ring) as client:
        chunks = list(client.stream(prompt="logprobs please", max_tokens=12, logprobs=3, **GREEDY))
        plain = client.generate(prompt="logprobs please", max_tokens=12, **GREEDY)
    token_ids = [t for c in chunks for t in c.token_ids]
    entries = [e for c in chunks for e in c.logprobs]
    assert len(token_ids) == len(entries) == 12 and token_ids == plain.token_ids and plain.logprobs is None
    for token_id, entry in zip(token_ids, entries):
        top = entry["top_logprobs"]
        assert len(top) == 3 and entry["logprob"] <= 0.0
        assert entry["logprob"] == pytest.approx(top[0]["logprob"])  # greedy picked the most likely token
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert sum(math.exp(t["logprob"]) for t in top) <= 1.0 + 1e-6
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]
    assert "".join(c.text for c in chunks) == plain.text


def test_completions_and_batches_carry_logprobs_and_bad_values_are_refused(daemon):
    with daemon.client() as client:
        completion = client.generate(prompt="x", max_tokens=5, logprobs=0, **GREEDY)
        results = client.generate_batch([{"prompt": f"b{i}", "max_tokens": 4, "logprobs": 1, **GREEDY}
                                         for i in range(3)] + [{"prompt": "bad", "logprobs": 21}])
        with pytest.raises(CbatchError) as err:
            client.generate(prompt="x", logprobs=-1)
    assert len(completion.logprobs) == 5 and all(e["top_logprobs"] == [] for e in completion.logprobs)
    assert all(len(r.logprobs) == 4 for r in results[:3])
    assert isinstance(results[3], CbatchError) and results[3].code == "invalid_request"
    assert err.value.code == "invalid_request" and "logprobs" in err.value.message


def test_async_client_gets_logprobs(daemon):
    async def run():
        client = await AsyncClient.connect(daemon.endpoint)
        try:
            return await client.generate(prompt="async", max_tokens=6, logprobs=2, **GREEDY)
        finally:
            await client.close()

    completion = asyncio.run(run())
    assert len(completion.logprobs) == 6 and all(len(e["top_logprobs"]) == 2 for e in completion.logprobs)
