"""The engine through real llama.cpp decode on the tiny random-weight model."""

import pytest
from common import GREEDY
from enginekit import collect, generate, run_to_completion, submit
from fakerunner import FakeRunner

from cbatch.errors import INVALID_REQUEST, PROMPT_TOO_LONG, QUEUE_FULL, CbatchError
from cbatch.params import parse_request
from cbatch.workers.engine.model_runner import ModelRunner


def test_the_llama_runner_and_the_fake_one_meet_the_engine_s_runner_interface(make_engine):
    assert isinstance(make_engine().runner, ModelRunner) and isinstance(FakeRunner(), ModelRunner)
    lacking = FakeRunner()
    del lacking.eog_ids  # control: a runner without one member is not one
    assert not isinstance(lacking, ModelRunner)


def test_many_mixed_length_requests_all_complete_past_parallel(make_engine):
    engine = make_engine()
    # Distinct first characters: prompts sharing a prefix would wait for each other's blocks.
    bodies = [{"prompt": "abcdefghij"[i] * (1 + 23 * i), "max_tokens": 5 + i, **GREEDY} for i in range(10)]
    ids = [submit(engine, body) for body in bodies]
    results: dict = {}
    collect(results, engine.step())
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 6
    run_to_completion(engine, results)
    for request_id, body in zip(ids, bodies):
        result = results[request_id]
        assert result.finish_reason == "length"
        assert len(result.token_ids) == body["max_tokens"] == result.usage["completion_tokens"]
    # Prompts longer than the step budget (64) were prefilled over several steps.
    assert results[ids[-1]].usage["prompt_tokens"] > 64 * 3


def test_identical_greedy_prompts_side_by_side_match_each_other_and_a_solo_run(make_engine):
    engine = make_engine()
    solo = generate(engine, [{"prompt": "Once upon a time", "max_tokens": 40, **GREEDY}])[0]
    side_by_side = generate(engine, [{"prompt": "Once upon a time", "max_tokens": 40, **GREEDY}] * 4)
    assert len(set(solo.token_ids)) > 3, "the tiny model should not repeat a single token"
    assert all(r.token_ids == solo.token_ids and r.text == solo.text for r in side_by_side)


def test_slot_reused_after_a_request_ends_starts_from_a_clean_cache(make_engine):
    engine = make_engine(parallel=1, ctx_size=256)
    first = generate(engine, [{"prompt": "abc", "max_tokens": 20, **GREEDY}])[0]
    other = generate(engine, [{"prompt": "zzzz yyyy", "max_tokens": 20, **GREEDY}])[0]
    again = generate(engine, [{"prompt": "abc", "max_tokens": 20, **GREEDY}])[0]
    assert other.token_ids != first.token_ids
    assert again.token_ids == first.token_ids


def test_stop_string_split_across_tokens_never_leaks(make_engine):
    engine = make_engine()
    free = generate(engine, [{"prompt": "hello", "max_tokens": 60, **GREEDY}])[0]
    stop = free.text[20:24]  # byte-level vocabulary: 4 characters span at least 4 tokens
    cut = free.text.index(stop)
    stopped = generate(engine, [{"prompt": "hello", "max_tokens": 60, "stop": ["never-seen", stop], **GREEDY}])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:cut]
    assert all(stop not in "".join(stopped.chunks[: i + 1]) for i in range(len(stopped.chunks)))
    # Text that only looked like the start of a stop string is released, not lost.
    held = generate(engine, [{"prompt": "hello", "max_tokens": 60, "stop": [free.text[-1] + "\x00\x01"], **GREEDY}])[0]
    assert held.finish_reason == "length" and held.text == free.text


def test_cancel_queued_and_running(make_engine):
    engine = make_engine(parallel=1, ctx_size=256)
    running = submit(engine, {"prompt": "a", "max_tokens": 100, **GREEDY})
    queued = submit(engine, {"prompt": "b", "max_tokens": 100, **GREEDY})
    results: dict = {}
    for _ in range(5):
        collect(results, engine.step())
    assert engine.cancel(queued) and engine.cancel(running)
    assert not engine.cancel(987654321)
    collect(results, engine.step())
    assert results[queued].finish_reason == "cancelled" and results[queued].token_ids == []
    assert results[queued].usage["completion_tokens"] == 0
    kept = results[running]
    assert kept.finish_reason == "cancelled" and 3 <= len(kept.token_ids) == kept.usage["completion_tokens"] < 100
    assert not engine.has_work and engine.scheduler.running == []
    # The freed slot serves the next request.
    assert generate(engine, [{"prompt": "c", "max_tokens": 3, **GREEDY}])[0].finish_reason == "length"


def test_context_cap_finishes_with_length(make_engine):
    engine = make_engine()  # llama.cpp rounds a sequence's context to a multiple of 256
    assert engine.ctx_per_seq == 256
    result = generate(engine, [{"prompt": "0" * 240, "max_tokens": 1000, **GREEDY}])[0]
    assert result.finish_reason == "length"
    assert result.usage["prompt_tokens"] + result.usage["completion_tokens"] == 256


def test_prompt_that_cannot_fit_is_rejected_before_admission(make_engine):
    engine = make_engine()
    with pytest.raises(CbatchError) as err:
        submit(engine, {"prompt": "y" * 300})
    assert err.value.code == PROMPT_TOO_LONG and "--ctx-size" in err.value.message
    assert not engine.has_work


def test_full_queue_rejects_and_keeps_the_others(make_engine):
    engine = make_engine(parallel=1, ctx_size=256, max_queue=1)
    first = submit(engine, {"prompt": "a", "max_tokens": 2, **GREEDY})
    results: dict = {}
    collect(results, engine.step())  # first takes the only slot
    second = submit(engine, {"prompt": "b", "max_tokens": 2, **GREEDY})
    with pytest.raises(CbatchError) as err:
        submit(engine, {"prompt": "c", "max_tokens": 2, **GREEDY})
    assert err.value.code == QUEUE_FULL
    run_to_completion(engine, results)
    assert set(results) == {first, second}
    assert all(r.finish_reason == "length" for r in results.values())


def test_bad_grammar_is_rejected_and_a_good_one_constrains(make_engine):
    engine = make_engine()
    with pytest.raises(CbatchError) as err:
        submit(engine, {"prompt": "a", "grammar": "root ::= ("})
    assert err.value.code == INVALID_REQUEST and "grammar" in err.value.message
    yes_no = 'root ::= ("yes" | "no") "."'
    results = generate(engine, [{"prompt": f"q{i}", "grammar": yes_no, "max_tokens": 20, "seed": i} for i in range(4)])
    for result in results:
        assert result.text in ("yes.", "no."), result.text
        assert result.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_seeds_differ(make_engine):
    engine = make_engine()
    body = {"prompt": "seed", "max_tokens": 30, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0,
            "ignore_eos": True}
    a, b, c = generate(engine, [{**body, "seed": 7}, {**body, "seed": 7}, {**body, "seed": 8}])
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_penalties_change_greedy_output(make_engine):
    engine = make_engine()
    plain, penalised = generate(engine, [
        {"prompt": "repeat", "max_tokens": 40, **GREEDY},
        {"prompt": "repeat", "max_tokens": 40, "repeat_penalty": 1.5, "frequency_penalty": 1.0, **GREEDY},
    ])
    assert plain.token_ids != penalised.token_ids
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))


def test_engine_statistics(make_engine):
    engine = make_engine()
    generate(engine, [{"prompt": "s" * 100, "max_tokens": 20, **GREEDY} for _ in range(4)])
    stats = engine.stats.snapshot()
    assert stats["requests_ended"] == 4
    assert stats["decode_tokens_per_s"] > 0 and stats["prefill_tokens_per_s"] > 0
    assert 3.0 <= stats["avg_concurrent_seqs"] <= 4.0
    assert 0.0 < stats["decode_fraction"] <= 1.0


def test_preparing_a_megabyte_prompt_leaves_the_loop_free(make_engine):
    # The decode worker prepares requests on a thread beside the loop; that only helps if
    # tokenizing lets go of the GIL (llama.cpp's tokenizer runs in ctypes). Steps the loop
    # makes while a 1 MB prompt is tokenized show that it does.
    import threading

    # One decode thread: with ggml's threads on every core, the tokenizing thread takes one
    # of them and a decode step waits at ggml's barrier for a descheduled thread, which
    # starves the loop for reasons that have nothing to do with the GIL.
    engine = make_engine(parallel=1, ctx_size=8192, threads=1)
    submit(engine, {"prompt": "x", "max_tokens": 8000, **GREEDY})
    collect({}, engine.step())
    outcome = []

    def prepare():  # the tokenizer alone: prepare() refuses a prompt this long before it tokenizes
        outcome.append(len(engine.runner.tokenize("word " * 200_000)))

    preparer = threading.Thread(target=prepare)
    preparer.start()
    num_steps = 0
    while preparer.is_alive():
        num_steps += bool(engine.step())  # each step generates a token
    preparer.join()
    assert outcome[0] >= 200_000  # it was tokenized in full
    assert num_steps >= 10, f"only {num_steps} steps while the prompt was tokenized"


def test_a_dead_end_and_a_cancel_in_the_same_step_end_the_request_once(make_engine):
    """A cancel (or a deadline) that lands while a step decodes is applied after that step's
    sampling: a request whose grammar came to a dead end in the same step was then ended
    twice, and the second end killed the decode worker (KeyError)."""
    engine = make_engine()
    engine.add_request(parse_request(1, {"prompt": "say nothing", "max_tokens": 4, "grammar": 'root ::= "\\x00"'}))
    engine.add_request(parse_request(2, {"prompt": "bystander", "max_tokens": 3, "temperature": 0, "ignore_eos": True}))
    sample = engine._sample

    def sample_then_cancel(spans):
        sampled = sample(spans)
        engine.cancel(1)  # as a cancel the loop applied while this batch decoded
        return sampled

    engine._sample = sample_then_cancel
    events = []
    for _ in range(20):
        events += engine.step()
        if not engine.has_work:
            break
    ends = [(event.request_id, event.finish_reason) for event in events if event.finish_reason]
    assert sorted(ends) == [(1, "cancelled"), (2, "length")]
