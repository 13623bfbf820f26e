"""The engine's prefix cache, eviction, preemption and decode failures, driven through
the fake runner (no model: every output is exact), then greedy equality on the tiny
real model through llama.cpp's own KV operations."""

import random

import pytest
from common import GREEDY
from enginekit import collect, generate, run_to_completion, submit
from fakerunner import FakeRunner

from cbatch.config import EngineConfig
from cbatch.workers.engine.engine import Engine


def fake_engine(prefix_cache=True, num_cells=1024, parallel=4, batch_size=64, cache_tokens=0, has_swa=False,
                unified=True, eog_at_length=None):
    config = EngineConfig(parallel=parallel, ctx_size=num_cells, batch_size=batch_size,
                          prefix_cache=prefix_cache, cache_tokens=cache_tokens, kv_unified=unified)
    return Engine(config, FakeRunner(num_cells, parallel, config.num_seq_ids, prefix_cache, has_swa, unified,
                                     eog_at_length))


# Greedy only: a sampler chain (min_tokens, temperature) needs a real vocabulary; those
# are tested on the tiny model (test_logit_bias_min_tokens.py).
@pytest.mark.parametrize("params, num_tokens, finish_reason", [
    ({"temperature": 0}, 5, "stop"),  # a 3-token prompt: the model picks end-of-generation at 8 tokens
    ({"temperature": 0, "ignore_eos": True}, 12, "length"),
])
def test_end_of_generation_ends_a_sequence_unless_ignore_eos(params, num_tokens, finish_reason):
    engine = fake_engine(eog_at_length=8)
    (result,) = generate(engine, [{"prompt": "abc", "max_tokens": 12, **params}])
    assert (len(result.token_ids), result.finish_reason) == (num_tokens, finish_reason)


def shared_prefix_bodies(seed, count, prefix_lengths=(5, 40, 90, 150)):
    rng = random.Random(seed)
    prefixes = ["".join(rng.choice("abcdefgh") for _ in range(n)) for n in prefix_lengths]
    bodies = []
    for _ in range(count):
        prompt = rng.choice(prefixes) + "".join(rng.choice("xyz") for _ in range(rng.randrange(0, 20)))
        bodies.append({"prompt": prompt, "max_tokens": rng.randrange(1, 30), **GREEDY})
    return bodies


@pytest.mark.parametrize("has_swa, unified", [(False, True), (True, True), (False, False)],
                         ids=["pool", "pool-swa", "streams"])
def test_outputs_are_the_same_with_the_cache_on_and_off(has_swa, unified):
    bodies = shared_prefix_bodies(seed=1, count=40)
    bodies += bodies[:5]  # wholly cached prompts
    on, off = fake_engine(has_swa=has_swa, unified=unified), fake_engine(prefix_cache=False)
    with_cache, without = generate(on, bodies), generate(off, bodies)
    assert [r.text for r in with_cache] == [r.text for r in without]
    assert all(r.usage["prompt_tokens"] == s.usage["prompt_tokens"] and
               r.usage["completion_tokens"] == s.usage["completion_tokens"] for r, s in zip(with_cache, without))
    stats_on, stats_off = on.snapshot(), off.snapshot()
    # Each request's usage names the prompt tokens it found computed; nothing was preempted here.
    assert sum(r.usage["cached_tokens"] for r in with_cache) == stats_on["prompt_tokens_reused"]
    assert not any(s.usage["cached_tokens"] for s in without)
    assert stats_on["prompt_tokens_reused"] > 0 and stats_on["cache_hit_rate"] > 0.3
    assert stats_off["prompt_tokens_reused"] == 0
    assert stats_on["prompt_tokens_computed"] + stats_on["prompt_tokens_reused"] == stats_off["prompt_tokens_computed"]


def test_eviction_under_memory_pressure_never_fails_a_request_nor_changes_an_output():
    bodies = shared_prefix_bodies(seed=2, count=60, prefix_lengths=(20, 50, 60, 70, 80))
    tight = fake_engine(num_cells=4 * 128, cache_tokens=4 * 128)  # room for little beyond the running
    results = generate(tight, bodies)
    assert all(r.finish_reason == "length" for r in results)
    assert [r.text for r in results] == [r.text for r in generate(fake_engine(prefix_cache=False), bodies)]
    stats = tight.snapshot()
    assert stats["prompt_tokens_reused"] > 0 and stats["kv_cells_used"] <= stats["kv_cells_total"]


def test_cancelling_a_sequence_whose_cells_are_shared_leaves_the_others_correct():
    prefix = "s" * 100
    bodies = [{"prompt": prefix + tail, "max_tokens": 20, **GREEDY} for tail in ("a", "b", "c")]
    expected = generate(fake_engine(prefix_cache=False), bodies)
    engine = fake_engine()
    ids = [submit(engine, body) for body in bodies]
    results: dict = {}
    while not all(results.get(i) and len(results[i].token_ids) >= 3 for i in ids):
        collect(results, engine.step())
    engine.cancel(ids[0])
    run_to_completion(engine, results)
    assert results[ids[0]].finish_reason == "cancelled"
    assert [results[i].text for i in ids[1:]] == [r.text for r in expected[1:]]
    assert engine.snapshot()["prompt_tokens_reused"] >= 2 * 96


def test_no_kv_room_preempts_the_newest_and_its_output_continues_exactly():
    bodies = [{"prompt": f"{i}" * 30, "max_tokens": 25, **GREEDY} for i in range(3)]
    expected = generate(fake_engine(), bodies)
    engine = fake_engine()
    ids = [submit(engine, body) for body in bodies]
    results: dict = {}
    for _ in range(8):
        collect(results, engine.step())
    newest = engine.scheduler.running[-1]
    engine.runner.fail_next = [1]  # llama_decode: no KV room
    collect(results, engine.step())
    assert newest in engine.scheduler.waiting and newest.num_cached == 0
    run_to_completion(engine, results)
    assert [results[i].text for i in ids] == [r.text for r in expected]
    assert all(results[i].finish_reason == "length" for i in ids)


def test_a_failed_decode_ends_only_that_steps_sequences():
    bodies = [{"prompt": f"{i}" * 10, "max_tokens": 10, **GREEDY} for i in range(4)]
    expected = generate(fake_engine(parallel=2, num_cells=256), bodies)
    engine = fake_engine(parallel=2, num_cells=256)
    ids = [submit(engine, body) for body in bodies]
    results: dict = {}
    collect(results, engine.step())
    engine.runner.fail_next = [-3]
    collect(results, engine.step())
    assert [results[i].finish_reason for i in ids[:2]] == ["error", "error"]
    assert "-3" in results[ids[0]].error
    run_to_completion(engine, results)
    assert [results[i].text for i in ids[2:]] == [r.text for r in expected[2:]]


@pytest.fixture
def tiny_engine(tiny_model_path):
    engines = []

    def make(**overrides):
        settings = {"model_path": tiny_model_path, "parallel": 4, "ctx_size": 4 * 512, "batch_size": 64, **overrides}
        engines.append(Engine(EngineConfig(**settings)))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("unified", [True, False], ids=["pool", "streams"])
def test_greedy_output_is_the_same_with_the_cache_on_and_off_on_a_real_model(tiny_engine, unified):
    system = "You answer in one word. " * 6
    prompts = [system + q for q in ("Sky?", "Grass?", "Snow?")] + ["short", system[:50] + "cut", system + "Sky?"]
    bodies = [{"prompt": p, "max_tokens": 24, **GREEDY} for p in prompts]
    on, off = tiny_engine(kv_unified=unified), tiny_engine(prefix_cache=False, kv_unified=unified)
    # One request at a time: the batch around each is the same in both engines.
    with_cache = [generate(on, [body])[0] for body in bodies]
    without = [generate(off, [body])[0] for body in bodies]
    assert [r.token_ids for r in with_cache] == [r.token_ids for r in without]
    stats = on.snapshot()
    assert stats["prefix_cache"] and stats["prompt_tokens_reused"] >= 3 * 128
    assert stats["cached_prefixes"] >= 1 and 0 < stats["kv_cells_evictable"] <= stats["kv_cells_used"]


@pytest.mark.parametrize("unified", [True, False], ids=["pool", "streams"])
def test_shared_prefix_side_by_side_on_a_real_model(tiny_engine, unified):
    system = "Context: the quick brown fox jumps over the lazy dog. " * 4
    bodies = [{"prompt": system + f"Q{i}", "max_tokens": 16, **GREEDY} for i in range(8)]
    engine = tiny_engine(kv_unified=unified)
    results = generate(engine, bodies)
    assert all(r.finish_reason == "length" and len(r.token_ids) == 16 for r in results)
    # Each request alone, without the cache: the same tokens (in streams, a token's
    # attention never sees another stream, so batching changes nothing there).
    if not unified:
        alone = tiny_engine(kv_unified=False, prefix_cache=False)
        assert [r.token_ids for r in results] == [generate(alone, [b])[0].token_ids for b in bodies]
    stats = engine.snapshot()
    # The first request computes the shared blocks once; the seven others reuse them.
    assert stats["prompt_tokens_reused"] >= 7 * 16 * (len(system) // 16 - 1)
