"""Priorities and deadlines: in the engine without a model, then through a real daemon with
--http and the official openai package (the tiny model: content does not matter)."""

import concurrent.futures
import json
import subprocess
import time

import openai
import pytest
from daemonkit import SCRIPTS_DIR, serve_module, wait_until
from enginekit import collect, submit
from fakerunner import FakeRunner
from httpkit import HttpDaemon

from cbatch.config import EngineConfig
from cbatch.workers.engine.engine import Engine

MODEL_ID = "tiny-llama.gguf"
ENDLESS = {"max_tokens": 100_000, "ignore_eos": True}
BATCH_TIMEOUT_S = 1.5
RUNNING_TIMEOUT_S = 2.0


def one_slot_engine() -> Engine:
    config = EngineConfig(parallel=1, ctx_size=1024, batch_size=64)
    return Engine(config, FakeRunner(1024, 1, config.num_seq_ids, unified=config.kv_unified))


def test_the_engine_ends_a_queued_request_at_its_deadline_and_a_running_one_with_what_it_made():
    engine = one_slot_engine()
    results = {}
    greedy = {"temperature": 0}  # the fake runner has no vocabulary for a sampler chain
    # The running one's deadline is far from the queued one's: a busy machine may pause this
    # test a while between two steps without the running one expiring early.
    running = submit(engine, {"prompt": "abc", **ENDLESS, **greedy, "timeout": RUNNING_TIMEOUT_S})
    queued = submit(engine, {"prompt": "xyz", "max_tokens": 4, **greedy, "timeout": 0.1})
    collect(results, engine.step())
    assert [seq.request_id for seq in engine.scheduler.waiting] == [queued]
    time.sleep(0.15)  # past the queued one's deadline
    collect(results, engine.step())
    assert engine.expired_while_queued == [queued] and queued not in results
    assert not engine.scheduler.waiting and results[running].finish_reason is None
    time.sleep(RUNNING_TIMEOUT_S)  # past the running one's deadline
    collect(results, engine.step())
    assert results[running].finish_reason == "timeout" and results[running].usage["completion_tokens"] >= 2
    assert not engine.has_work


def test_thousands_of_deadlines_passing_at_once_end_over_several_steps():
    """Each look at the deadlines ends at most MAX_EXPIRIES_PER_PASS of them, so the running
    streams' steps stay short; every one of them ends, and the running one goes on."""
    from cbatch.workers.engine.sched.scheduler import MAX_EXPIRIES_PER_PASS

    config = EngineConfig(parallel=1, ctx_size=1024, batch_size=64, max_queue=4096)
    engine = Engine(config, FakeRunner(1024, 1, config.num_seq_ids, unified=config.kv_unified))
    results, greedy = {}, {"temperature": 0}
    running = submit(engine, {"prompt": "abc", **ENDLESS, **greedy})
    collect(results, engine.step())
    num_queued = 3 * MAX_EXPIRIES_PER_PASS + 5
    queued = {submit(engine, {"prompt": f"q{i}", "max_tokens": 4, **greedy}) for i in range(num_queued)}
    for seq in engine.scheduler.waiting:
        seq.deadline_s = 0.0  # long past
    engine.scheduler.deadlines = type(engine.scheduler.deadlines)()
    for seq in engine.scheduler.waiting:
        engine.scheduler.deadlines.add(seq)
    num_expired_by_step = []
    while len(engine.expired_while_queued) < num_queued:
        num_before = len(engine.expired_while_queued)
        collect(results, engine.step())
        num_expired_by_step.append(len(engine.expired_while_queued) - num_before)
    # A step looks at the deadlines twice (before its batch and after it: see Engine.step).
    assert max(num_expired_by_step) <= 2 * MAX_EXPIRIES_PER_PASS and len(num_expired_by_step) >= 2
    assert set(engine.expired_while_queued) == queued and results[running].finish_reason is None


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    yield from serve_module(HttpDaemon(tiny_model_path, "--parallel", "1", "--batch-timeout", str(BATCH_TIMEOUT_S)))


def _occupy_the_slot(api):
    """A streamed request that holds the only slot until it is closed."""
    blocker = api.completions.create(model=MODEL_ID, prompt="hold", stream=True, extra_body=ENDLESS)
    next(iter(blocker))
    return blocker


def test_interactive_requests_are_admitted_ahead_of_a_queued_batch(daemon, api):
    blocker = _occupy_the_slot(api)
    first_token_s = {}

    def ask(name: str, priority: str) -> None:
        stream = api.completions.create(model=MODEL_ID, prompt=f"go {name}", max_tokens=24, temperature=0, stream=True,
                                        extra_body={"priority": priority, "ignore_eos": True, "timeout": 60})
        first_token_s[name] = time.monotonic()
        list(stream)

    with concurrent.futures.ThreadPoolExecutor(4) as pool, daemon.client() as client:
        batch = [pool.submit(ask, f"batch{i}", "batch") for i in range(3)]
        wait_until(lambda: client.stats()["num_queued"] == 3, timeout_s=60.0)
        interactive = pool.submit(ask, "interactive", "interactive")
        wait_until(lambda: client.stats()["num_queued"] == 4, timeout_s=60.0)
        blocker.close()  # frees the slot: the interactive request, queued last, goes first
        for future in (interactive, *batch):
            future.result(timeout=60)
    assert first_token_s["interactive"] < min(first_token_s[f"batch{i}"] for i in range(3))


def test_a_deadline_that_passes_while_queued_is_a_408_deadline_exceeded(daemon, api):
    blocker = _occupy_the_slot(api)
    try:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as caught:
            api.completions.create(model=MODEL_ID, prompt="x", max_tokens=4, extra_body={"timeout": 0.5})
        assert 0.5 <= time.monotonic() - started < 5.0
    finally:
        blocker.close()
    assert caught.value.status_code == 408 and caught.value.body["code"] == "deadline_exceeded"


def test_a_deadline_that_passes_while_running_ends_with_timeout_and_what_was_produced(api):
    reply = api.completions.create(model=MODEL_ID, prompt="x", extra_body={**ENDLESS, "timeout": 0.5})
    assert reply.choices[0].finish_reason == "timeout" and reply.usage.completion_tokens > 0
    assert reply.choices[0].text


def test_the_daemons_default_timeout_applies_to_batch_requests_that_set_none(api):
    started = time.monotonic()
    reply = api.completions.create(model=MODEL_ID, prompt="x", extra_body={**ENDLESS, "priority": "batch"})
    assert reply.choices[0].finish_reason == "timeout"
    assert BATCH_TIMEOUT_S <= time.monotonic() - started < BATCH_TIMEOUT_S + 5.0


@pytest.mark.parametrize("field, value", [("priority", "urgent"), ("timeout", 0), ("timeout", "soon")])
def test_a_bad_priority_or_timeout_is_a_400_naming_it(api, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=MODEL_ID, prompt="x", max_tokens=2, extra_body={field: value})
    assert caught.value.body["param"] == field and caught.value.body["code"] == "invalid_request"


@pytest.mark.parametrize("line", [
    {"id": "native", "prompt": "x", **ENDLESS},
    {"custom_id": "openai", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", **ENDLESS}},
])
def test_batch_file_lines_are_batch_priority_and_get_the_batch_timeout(daemon, tmp_path, line):
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    run = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(tmp_path / "in.jsonl")], env=daemon.env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    choice = out["response"]["body"]["choices"][0] if "custom_id" in line else out
    assert choice["finish_reason"] == "timeout"
