"""A request's `n` choices compute their prompt once, in both KV layouts: the first choice
computes it and the others fork its KV (workers/engine/sched/forks.py). Through real llama.cpp
decode on the tiny model, then edge cases on the fake runner, then through the daemon."""

import functools
import random

import pytest
from common import GREEDY
from daemonkit import wait_until
from enginekit import collect, generate, run_to_completion, submit
from test_engine_cache import fake_engine

from cbatch.openai.choices import expand_choices

LAYOUTS = pytest.mark.parametrize("unified", [False, True], ids=["streams", "pool"])
SAMPLED = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


@pytest.fixture
def make_engine(make_engine):
    """Sampling on the host unless a test asks otherwise: only host rows can be shared."""
    return functools.partial(make_engine, backend_sampling=False)


def prompt_of(engine, num_tokens: int) -> str:
    """A prompt the engine's tokenizer makes exactly num_tokens tokens of."""
    for length in range(1, 20 * num_tokens):
        text = "".join("abcdefghij"[(i * 7) % 10] for i in range(length))
        if len(engine.runner.tokenize(text)) == num_tokens:
            return text
    raise AssertionError(f"no prompt of {num_tokens} tokens")


@LAYOUTS
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_four_choices_compute_a_30_token_prompt_once_and_match_a_single_request(make_engine, unified, overlap):
    alone = make_engine(kv_unified=unified)
    prompt = prompt_of(alone, 30)
    (single,) = generate(alone, [{"prompt": prompt, "max_tokens": 12, **GREEDY}])
    engine = make_engine(kv_unified=unified, overlap=overlap)
    assert engine.is_overlapped is overlap
    choices = generate(engine, expand_choices({"prompt": prompt, "n": 4, "max_tokens": 12, **GREEDY}))
    assert [c.token_ids for c in choices] == [single.token_ids] * 4
    assert all((c.usage["prompt_tokens"], c.usage["completion_tokens"]) == (30, 12) for c in choices)
    stats = engine.snapshot()
    assert (stats["prompt_tokens_computed"], stats["prompt_tokens_reused"]) == (30, 90)
    assert [c.usage["cached_tokens"] for c in choices] == [0, 30, 30, 30]  # each fork's usage names its copy


@LAYOUTS
def test_each_forked_choice_samples_as_it_would_alone(make_engine, unified):
    engine = make_engine(kv_unified=unified)
    prompt = prompt_of(engine, 30)
    bodies = expand_choices({"prompt": prompt, "n": 4, "seed": 11, "max_tokens": 16, **SAMPLED})
    choices = generate(engine, bodies)
    assert engine.snapshot()["prompt_tokens_computed"] == 30
    alone = [generate(make_engine(kv_unified=unified), [body])[0] for body in bodies[:2]]
    assert [c.token_ids for c in choices[:2]] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in choices}) > 1, "each choice has its own seed"


@LAYOUTS
@pytest.mark.parametrize("steps_before, num_computed", [(1, 30), (2, 30 + 3)], ids=["next-step", "later"])
def test_choices_arriving_after_the_prompt_is_computed(make_engine, unified, steps_before, num_computed):
    """Arriving between the step that computed the prompt and the next decode, a choice
    samples from the first choice's logits row (still in llama.cpp's buffer) and computes
    nothing; arriving later still, it computes only the last prompt token."""
    engine = make_engine(kv_unified=unified)
    prompt = prompt_of(engine, 30)
    body = {"prompt": prompt, "max_tokens": 12, **GREEDY}
    results: dict = {}
    first = submit(engine, body)
    for _ in range(steps_before):  # the whole prompt and the first token, then one more token
        collect(results, engine.step())
    late = [submit(engine, body) for _ in range(3)]
    run_to_completion(engine, results)
    assert [results[i].token_ids for i in late] == [results[first].token_ids] * 3
    assert engine.snapshot()["prompt_tokens_computed"] == num_computed


@LAYOUTS
def test_a_fork_that_cannot_share_the_row_computes_only_the_last_token(make_engine, unified):
    """A greedy choice masking end-of-generation (ignore_eos) beside one that does not: the
    masked row cannot serve both, so the second computes its last prompt token itself."""
    engine = make_engine(kv_unified=unified)
    prompt = prompt_of(engine, 30)
    bodies = [{"prompt": prompt, "max_tokens": 6, **GREEDY}, {"prompt": prompt, "max_tokens": 6, "temperature": 0}]
    masked, unmasked = generate(engine, bodies)
    assert engine.snapshot()["prompt_tokens_computed"] == 30 + 1
    (alone,) = generate(make_engine(kv_unified=unified), bodies[1:])
    assert unmasked.token_ids == alone.token_ids


def test_backend_sampled_choices_compute_only_their_last_prompt_token(make_engine):
    """A row sampled in llama.cpp's graph is not kept on the host: each fork copies all but
    the last prompt token and computes that one itself."""
    prompt = prompt_of(make_engine(), 30)
    (single,) = generate(make_engine(), [{"prompt": prompt, "max_tokens": 12, **GREEDY}])
    engine = make_engine(backend_sampling=True)
    choices = generate(engine, expand_choices({"prompt": prompt, "n": 4, "max_tokens": 12, **GREEDY}))
    assert [c.token_ids for c in choices] == [single.token_ids] * 4
    assert engine.snapshot()["prompt_tokens_computed"] == 30 + 3


def test_forked_choices_report_the_logprobs_of_a_single_request(make_engine):
    prompt = prompt_of(make_engine(), 30)
    body = {"prompt": prompt, "max_tokens": 4, "logprobs": 3, **GREEDY}
    (single,) = generate(make_engine(), [body])
    engine = make_engine()
    choices = generate(engine, [body] * 3)
    assert engine.snapshot()["prompt_tokens_computed"] == 30
    assert all(c.chunks == single.chunks and c.token_ids == single.token_ids for c in choices)


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "pool"])
def test_choices_in_a_small_pool_compute_each_prompt_once_and_keep_every_output(unified):
    """Groups of identical prompts among others, in a pool too small for all of them
    (preemption, eviction, forks going back to the queue): every output is unchanged."""
    rng = random.Random(5)
    bodies = []
    for _ in range(30):
        prompt = "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(1, 90)))
        bodies += expand_choices({"prompt": prompt, "n": rng.choice([1, 2, 4]), "max_tokens": rng.randrange(1, 40),
                                  **GREEDY})
    expected = generate(fake_engine(prefix_cache=False), bodies)
    engine = fake_engine(unified=unified, num_cells=4 * 128, cache_tokens=4 * 64, batch_size=32)
    assert [r.token_ids for r in generate(engine, bodies)] == [r.token_ids for r in expected]
    # each distinct prompt computed once, plus at most its last token per other choice
    prompts = {body["prompt"] for body in bodies}
    assert engine.snapshot()["prompt_tokens_computed"] <= sum(map(len, prompts)) + len(bodies) - len(prompts)


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "pool"])
def test_a_parent_preempted_before_its_prompt_is_computed_takes_its_forks_back_to_the_queue(unified):
    """No KV room at the decode (the fake runner says so): the newest sequence, the first
    choice, goes back to the queue, its forks behind it; the prompt is then computed once."""
    other = {"prompt": "z" * 5, "max_tokens": 30, **GREEDY}
    bodies = expand_choices({"prompt": "p" * 60, "n": 3, "max_tokens": 10, **GREEDY})
    expected = generate(fake_engine(prefix_cache=False), [other, *bodies])
    engine = fake_engine(unified=unified, batch_size=16)
    ids = [submit(engine, body) for body in [other, *bodies]]
    engine.runner.fail_next = [1]
    results = run_to_completion(engine)
    assert [results[i].token_ids for i in ids] == [r.token_ids for r in expected]
    assert engine.snapshot()["prompt_tokens_computed"] == 5 + 60


def three_choices_after_one_step(unified: bool):
    """Three choices of a 60-token prompt on a fake engine whose batch takes 16 tokens, one
    step in: (engine, their ids, results so far, what one of them alone produces)."""
    bodies = expand_choices({"prompt": "p" * 60, "n": 3, "max_tokens": 10, **GREEDY})
    (expected,) = generate(fake_engine(prefix_cache=False), bodies[:1])
    engine = fake_engine(unified=unified, batch_size=16)
    ids = [submit(engine, body) for body in bodies]
    results: dict = {}
    collect(results, engine.step())
    return engine, ids, results, expected


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "pool"])
def test_cancelling_the_choice_that_computes_the_prompt_hands_it_to_a_waiting_one(unified):
    """The prompt takes several steps (batch of 16 tokens); the first choice is cancelled
    half way: its forks go back to the queue, one of them computes the prompt, and every
    output is what it would have been."""
    engine, ids, results, expected = three_choices_after_one_step(unified)
    assert len(engine.scheduler.forks) == 2
    engine.cancel(ids[0])
    run_to_completion(engine, results)
    assert results[ids[0]].finish_reason == "cancelled"
    assert [results[i].token_ids for i in ids[1:]] == [expected.token_ids] * 2
    assert engine.snapshot()["kv_cells_used"] <= engine.snapshot()["kv_cells_total"]


def test_choices_through_the_daemon_compute_the_prompt_once(tiny_model_path, start_daemon):
    """Client.generate(n=4) sends four requests; the worker gets the later ones during or
    after the step that computes the first one's prompt. Each shares the first one's row
    then; one that came later still would compute its last prompt token."""
    daemon = start_daemon(tiny_model_path, "--parallel", "4")
    with daemon.client(use_ring=False) as client:
        before = client.stats()
        completions = client.generate(prompt="abcdefghij" * 3, n=4, max_tokens=64, **GREEDY)
        # the worker reports its stats between steps: wait for the report of the last one
        wait_until(lambda: client.stats()["requests_ended"] == before["requests_ended"] + 4, timeout_s=60.0)
        after = client.stats()
    num_prompt = completions[0].usage["prompt_tokens"]
    assert len({tuple(c.token_ids) for c in completions}) == 1
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert num_prompt <= computed <= num_prompt + 3


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "pool"])
def test_cancelling_a_waiting_fork_frees_its_slot_and_leaves_the_others_alone(unified):
    engine, ids, results, expected = three_choices_after_one_step(unified)
    engine.cancel(ids[1])
    collect(results, engine.step())
    assert len(engine.scheduler.forks) == 1 and results[ids[1]].finish_reason == "cancelled"
    run_to_completion(engine, results)
    assert [results[i].token_ids for i in (ids[0], ids[2])] == [expected.token_ids] * 2
    assert engine.snapshot()["prompt_tokens_computed"] == 60
    assert engine.snapshot()["kv_cells_used"] == engine.scheduler.kv.num_cells_evictable
