"""Overlap (step N+1 decodes while step N's text is made and published) through real
llama.cpp decode on the tiny model: the same requests give the same events, step by step,
with it on and off."""

import json

import llama_cpp
import pytest
from common import GREEDY
from enginekit import collect, generate, run_to_completion, submit

from cbatch.config import EngineConfig
from cbatch.workers.engine.engine import Engine


@pytest.fixture
def make_engine(tiny_model_path):
    engines = []

    def make(overlap: bool, **overrides):
        settings = {"model_path": tiny_model_path, "parallel": 4, "ctx_size": 4 * 256, "batch_size": 64,
                    "overlap": overlap, **overrides}
        engine = Engine(EngineConfig(**settings))
        assert engine.is_overlapped is overlap
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def run_steps(engine, bodies: list[dict], cancel_at: dict[int, int] | None = None) -> list[tuple]:
    """Submit the bodies, step to the end, cancelling body i after step cancel_at[i];
    returns each request's (text chunks per step, token ids, finish reason, usage)."""
    ids = [submit(engine, body) for body in bodies]
    results: dict = {}
    num_steps = 0
    while engine.has_work:
        collect(results, engine.step())
        num_steps += 1
        for i, at_step in (cancel_at or {}).items():
            if at_step == num_steps:
                engine.cancel(ids[i])
    return [(r.chunks, r.token_ids, r.finish_reason, r.usage) for r in (results[i] for i in ids)]


def test_the_default_is_on_where_layers_are_offloaded_and_off_on_a_cpu_build(tiny_model_path):
    engine = Engine(EngineConfig(model_path=tiny_model_path, parallel=1, ctx_size=256))
    try:
        is_gpu_build = bool(llama_cpp.llama_supports_gpu_offload())
        assert (engine.runner.num_gpu_layers > 0) == is_gpu_build and engine.is_overlapped == is_gpu_build
        assert engine.description.endswith("overlap on" if is_gpu_build else "overlap off")
    finally:
        engine.close()


def test_streams_match_with_stop_strings_max_tokens_and_more_requests_than_slots(make_engine):
    off, on = make_engine(False), make_engine(True)
    free = generate(off, [{"prompt": "hello", "max_tokens": 60, **GREEDY}])[0]
    stops = [free.text[20:24], free.text[7:9]]
    bodies = [{"prompt": "hello", "max_tokens": 60, "stop": [stops[0]], **GREEDY},
              {"prompt": "hello", "max_tokens": 60, "stop": ["never-seen", stops[1]], **GREEDY}]
    # max_tokens ending at every step from the first on, so sequences leave (and queued
    # ones are admitted into their slots) at each step boundary.
    bodies += [{"prompt": f"{'abcdefgh'[i]} river", "max_tokens": 1 + 2 * i, **GREEDY} for i in range(8)]
    bodies += [{"prompt": "seeded", "max_tokens": 12, "temperature": 0.9, "seed": 5, "ignore_eos": True},
               {"prompt": "not ignoring eos", "max_tokens": 40, "temperature": 0}]
    expected = run_steps(off, bodies)
    assert [r[2] for r in expected[:2]] == ["stop", "stop"]
    assert run_steps(on, bodies) == expected


def test_a_stop_string_drops_the_token_decoded_after_it_and_its_kv(make_engine):
    off, on = make_engine(False, parallel=1, ctx_size=256), make_engine(True, parallel=1, ctx_size=256)
    free = generate(off, [{"prompt": "hello", "max_tokens": 60, **GREEDY}])[0]
    body = {"prompt": "hello", "max_tokens": 60, "stop": [free.text[20:24]], **GREEDY}
    request_id = submit(on, body)
    results: dict = {}
    while request_id not in results or results[request_id].finish_reason is None:
        collect(results, on.step())
    # The stop string was found after the next batch was queued: the sequence is in it.
    assert on._in_flight is not None and [span.seq.request_id for span in on._in_flight] == [request_id]
    run_to_completion(on, results)  # that batch's token for it is never published
    stopped = results[request_id]
    assert (stopped.finish_reason, stopped.text) == ("stop", free.text[:free.text.index(body["stop"][0])])
    assert stopped.token_ids == generate(off, [body])[0].token_ids
    assert stopped.usage["completion_tokens"] == len(stopped.token_ids)
    # The slot's KV holds nothing of the dropped token: its next requests (one reusing the
    # cached prefix, one not) decode as on an engine that never overlapped.
    after = [{"prompt": "hello", "max_tokens": 30, **GREEDY}, {"prompt": "zzzz yyyy", "max_tokens": 30, **GREEDY}]
    assert [r.token_ids for r in generate(on, after)] == [r.token_ids for r in generate(off, after)]


@pytest.mark.parametrize("kv_unified", [False, True])
def test_cancels_at_step_boundaries_end_streams_alike(make_engine, kv_unified):
    off, on = make_engine(False, kv_unified=kv_unified), make_engine(True, kv_unified=kv_unified)
    bodies = [{"prompt": f"{'pqrstu'[i]} cancel me", "max_tokens": 50, **GREEDY} for i in range(6)]
    # Running ones after their first, second and fifth step, a queued one before it ran.
    cancel_at = {0: 1, 1: 2, 2: 5, 5: 1}
    expected = run_steps(off, bodies, cancel_at)
    assert [r[2] for r in expected] == ["cancelled"] * 3 + ["length"] * 2 + ["cancelled"]
    assert expected[5][1] == [] and 1 <= len(expected[0][1]) < len(expected[2][1]) < 50
    assert run_steps(on, bodies, cancel_at) == expected
    assert not on.has_work and on.scheduler.running == []


def test_a_daemon_with_overlap_serves_the_same_completions(start_daemon, tiny_model_path, make_engine):
    """Through the decode worker: it publishes step N (ring, tick, front-end) while the
    runner's decode thread computes step N+1."""
    off = make_engine(False, prefix_cache=False)
    free = generate(off, [{"prompt": "served", "max_tokens": 40, **GREEDY}])[0]
    bodies = [{"prompt": "served", "max_tokens": 40, "stop": [free.text[12:15]], **GREEDY},
              {"prompt": "served", "max_tokens": 40, **GREEDY}, {"prompt": "other", "max_tokens": 7, **GREEDY}]
    expected = [generate(off, [body])[0] for body in bodies]
    daemon = start_daemon(tiny_model_path, "--parallel", "4", "--ctx-size", "1024", "--batch-size", "64",
                          "--overlap", "--no-prefix-cache")
    assert ", overlap on" in daemon.health["model"]
    with daemon.client() as client:
        for body, want in zip(bodies, expected):
            chunks = list(client.stream(**body))  # each decoded alone, as the reference was
            assert "".join(c.text for c in chunks) == want.text
            assert sum((c.token_ids for c in chunks), []) == want.token_ids
            assert chunks[-1].finish_reason == want.finish_reason and chunks[-1].usage == want.usage
        many = client.generate_batch([{**body, "id": str(i)} for i, body in enumerate(bodies * 4)], max_in_flight=12)
    # Side by side the batches differ from the reference's (llama.cpp's kernels are not
    # batch invariant), so only what holds for any tokens is checked.
    assert all(r.finish_reason in ("stop", "length") and len(r.token_ids) == r.usage["completion_tokens"]
               for r in many)
    assert all(bodies[0]["stop"][0] not in r.text for r in many[::3])


def test_backend_sampled_streams_match_and_a_stopped_sequences_chain_outlives_its_batch(make_engine):
    # A seeded chain runs inside llama_decode's graph: the chain of a sequence that a stop
    # string ended is still attached while the batch queued after it decodes.
    off, on = make_engine(False, backend_sampling=True), make_engine(True, backend_sampling=True)
    free = generate(off, [{"prompt": "graph", "max_tokens": 40, "temperature": 0.7, "seed": 3}])[0]
    bodies = [{"prompt": "graph", "max_tokens": 40, "temperature": 0.7, "seed": 3, "stop": [free.text[6:9]]},
              {"prompt": "graph", "max_tokens": 9, **GREEDY},
              {"prompt": "other graph", "max_tokens": 30, "temperature": 1.1, "seed": 9, "ignore_eos": True}]
    expected = run_steps(off, bodies, {2: 6})
    assert [r[2] for r in expected] == ["stop", "length", "cancelled"]
    assert run_steps(on, bodies, {2: 6}) == expected


def test_constrained_rows_masked_ahead_pick_what_checked_rows_pick(make_engine):
    """With overlap, a row that missed gets its next mask while the next batch decodes and
    skips its next check: greedy answers are the same as without; a seeded one draws once
    where it would have drawn twice (a miss's first draw is skipped), so it is its own
    answer under the same schema."""
    off, on = make_engine(False), make_engine(True)
    schema = {"type": "object", "additionalProperties": False, "required": ["word", "n"],
              "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "maximum": 99}}}
    samplings = [{"temperature": 0}, {"temperature": 0}, {"temperature": 0.9, "seed": 5},
                 {"temperature": 0.9, "seed": 6}]
    bodies = [{"prompt": f"{i} json", "max_tokens": 40, "json_schema": schema, **sampling}
              for i, sampling in enumerate(samplings)]
    expected, overlapped = run_steps(off, bodies), run_steps(on, bodies)
    assert overlapped[:2] == expected[:2]
    assert on.structured.rows.num_prefetched > 0  # the tiny model misses: masks were made ahead
    for chunks, _, finish, _ in expected[2:] + overlapped[2:]:
        assert finish == "stop" and set(json.loads("".join(chunks))) == {"word", "n"}
