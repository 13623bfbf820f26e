"""Batch work yields its slots to interactive work: the scheduler's choice without a model,
then the engine on the tiny model (real llama.cpp decodes), where a preempted batch
sequence must end with exactly the output it has without the pause."""

import pytest
from enginekit import collect, generate, run_to_completion, submit

from cbatch.params import SamplingParams
from cbatch.workers.engine.kv.pool import PoolCacheManager
from cbatch.workers.engine.sched.scheduler import Scheduler
from cbatch.workers.engine.sequence import SeqStatus, Sequence

BATCH_LINE = {"max_tokens": 48, "ignore_eos": True, "priority": "batch"}
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "top_k": 40, "seed": 7}
MAX_STEPS_TO_FIRST_TOKEN = 2  # the step that admits the interactive request computes its prompt and samples


def two_slot_scheduler(preempt_batch=True) -> Scheduler:
    kv = PoolCacheManager(4096, 8, True, max_cached_cells=2048)
    return Scheduler(kv, 2, 64, 8, 8, preempt_batch)


def make_seq(request_id, num_prompt, is_batch):
    start = 1000 * request_id  # distinct prompts: nothing shared
    return Sequence(request_id, list(range(start, start + num_prompt)), SamplingParams(), is_batch=is_batch)


def run_steps(sched, num_steps):
    """What the engine does after each decode: the spans are computed, sampled ones get a token."""
    for _ in range(num_steps):
        for span in sched.schedule():
            sched.on_computed(span)
            if span.wants_logits:
                span.seq.output_ids.append(7)


def test_an_interactive_arrival_takes_the_slot_of_the_batch_sequence_that_loses_least():
    sched = two_slot_scheduler()
    old, new = make_seq(0, 40, True), make_seq(1, 8, True)
    sched.add(old)
    run_steps(sched, 1)
    sched.add(new)
    run_steps(sched, 3)  # both generate; `new`, admitted later with a shorter prompt, computed fewer tokens
    interactive = make_seq(2, 5, False)
    sched.add(interactive)
    spans = sched.schedule()
    assert interactive in [span.seq for span in spans] and sched.running == [old, interactive]
    assert new.status is SeqStatus.WAITING and new.seq_id is None and new.output_ids == [7] * 3
    assert list(sched.waiting) == [new] and sched.num_preemptions == 1
    sched.finish(interactive, keep_cached=True)
    run_steps(sched, 1)  # back at the head of the batch queue: it recomputes prompt + output and samples
    assert sched.running == [old, new] and new.num_cached == new.num_tokens - 1 and new.output_ids == [7] * 4


def test_a_long_preempted_sequence_resumes_from_the_prefix_cache():
    sched = two_slot_scheduler()
    batch = [make_seq(i, 40, True) for i in range(2)]
    for seq in batch:
        sched.add(seq)
    run_steps(sched, 2)
    sched.add(make_seq(9, 5, False))
    run_steps(sched, 1)
    preempted = next(seq for seq in batch if seq.status is SeqStatus.WAITING)
    sched.finish(sched.running[-1], keep_cached=True)  # the interactive request ends
    reused = sched.kv.num_tokens_reused
    sched.schedule()
    assert preempted.seq_id is not None and sched.kv.num_tokens_reused - reused == 32  # two full blocks kept


@pytest.mark.parametrize("are_running_batch, preempt_batch", [
    (False, True),  # interactive work never preempts interactive work
    (True, False),  # batch work is not preempted when preemption is off
])
def test_an_interactive_arrival_waits_when_no_running_sequence_may_be_preempted(are_running_batch, preempt_batch):
    sched = two_slot_scheduler(preempt_batch)
    for i in range(2):
        sched.add(make_seq(i, 6, are_running_batch))
    run_steps(sched, 2)
    interactive = make_seq(5, 6, False)
    sched.add(interactive)
    run_steps(sched, 3)
    assert interactive.status is SeqStatus.WAITING and sched.num_preemptions == 0


def steps_to_first_token(engine, results, request_id, max_steps=50):
    for steps in range(1, max_steps + 1):
        collect(results, engine.step())
        if results.get(request_id) and results[request_id].token_ids:
            return steps
    raise AssertionError("no first token")


@pytest.mark.parametrize("unified", [True, False], ids=["pool", "streams"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("options", [{}, {"overlap": True}, {"backend_sampling": True}],
                         ids=["host", "overlap", "backend-sampling"])
def test_an_interactive_request_gets_its_first_token_at_once_and_batch_output_is_unchanged(make_engine, unified,
                                                                                           sampling, options):
    """Also with overlap (the batch preempted is scheduled while nothing decodes) and with
    sampling in llama.cpp's graph (a preempted chain moves to another sequence id)."""
    bodies = [{"prompt": f"Batch line {i}: keep counting", **BATCH_LINE, **sampling} for i in range(2)]
    unpreempted = generate(make_engine(parallel=2, ctx_size=2 * 256, kv_unified=unified, **options), bodies)
    engine = make_engine(parallel=2, ctx_size=2 * 256, kv_unified=unified, **options)
    batch_ids = [submit(engine, body) for body in bodies]
    results: dict = {}
    for _ in range(10):
        collect(results, engine.step())
    interactive = submit(engine, {"prompt": "A quick question", "max_tokens": 8, **GREEDY})
    assert steps_to_first_token(engine, results, interactive) <= MAX_STEPS_TO_FIRST_TOKEN
    assert all(len(results[i].token_ids) < BATCH_LINE["max_tokens"] for i in batch_ids)
    run_to_completion(engine, results)
    assert engine.snapshot()["num_preemptions"] >= 1
    assert results[interactive].finish_reason == "length" and len(results[interactive].token_ids) == 8
    assert [results[i].token_ids for i in batch_ids] == [r.token_ids for r in unpreempted]
    assert [results[i].text for i in batch_ids] == [r.text for r in unpreempted]


def test_a_batch_sequence_preempted_again_and_again_finishes_once_interactive_load_stops(make_engine):
    body = {"prompt": "One long batch line", **BATCH_LINE, **GREEDY}
    unpreempted = generate(make_engine(parallel=1, ctx_size=256), [body])[0]
    engine = make_engine(parallel=1, ctx_size=256)
    batch_id = submit(engine, body)
    results: dict = {}
    for i in range(6):  # each arrival finds the batch line running again: it preempts it
        collect(results, engine.step())
        collect(results, engine.step())
        interactive = submit(engine, {"prompt": f"Question {i}", "max_tokens": 2, **GREEDY})
        assert steps_to_first_token(engine, results, interactive) <= MAX_STEPS_TO_FIRST_TOKEN
    assert engine.snapshot()["num_preemptions"] == 6
    run_to_completion(engine, results)
    assert results[batch_id].finish_reason == "length" and results[batch_id].token_ids == unpreempted.token_ids


def test_without_preemption_the_interactive_request_waits_for_a_batch_line_to_end(make_engine):
    engine = make_engine(parallel=1, ctx_size=256, preempt_batch=False)
    batch_id = submit(engine, {"prompt": "One long batch line", **BATCH_LINE, **GREEDY})
    results: dict = {}
    for _ in range(4):
        collect(results, engine.step())
    interactive = submit(engine, {"prompt": "A quick question", "max_tokens": 2, **GREEDY})
    steps_to_first_token(engine, results, interactive, max_steps=200)
    assert results[batch_id].finish_reason == "length" and engine.snapshot()["num_preemptions"] == 0


def test_interactive_prompt_chunks_take_the_step_first_and_batch_ones_a_quarter_beside_them():
    sched = two_slot_scheduler()
    batch = make_seq(0, 400, True)
    sched.add(batch)
    assert [(s.seq, s.num_tokens) for s in sched.schedule()] == [(batch, 64)]  # alone: the whole step
    interactive = make_seq(1, 40, False)
    sched.add(interactive)
    step = sched.schedule()
    spans = {span.seq: span.num_tokens for span in step}
    # Admitted after the batch prompt, it is served first; the batch chunk gets a quarter.
    assert spans == {interactive: 40, batch: 64 // 4}
    for span in step:
        sched.on_computed(span)
    interactive.output_ids.append(7)  # it sampled its first token; its slow client then pauses it
    sched.set_paused(interactive, True)
    spans = {span.seq: span.num_tokens for span in sched.schedule()}
    assert spans == {batch: 64}  # a paused request waits on no step: the batch chunk gets the whole step


def test_out_of_cells_a_batch_sequence_is_preempted_before_a_newer_interactive_one():
    kv = PoolCacheManager(40, 8, False, max_cached_cells=0)
    sched = Scheduler(kv, 2, 64, 8, 8, preempt_batch=False)
    batch, interactive = make_seq(0, 19, True), make_seq(1, 19, False)
    sched.add(batch)
    run_steps(sched, 1)
    sched.add(interactive)
    run_steps(sched, 2)  # 38 of 40 cells, then both need one more: one must go
    assert interactive in sched.running and batch not in sched.running
    assert list(sched.waiting) == [batch] and batch.num_cached == 0


def test_a_preempted_batch_sequence_resumes_before_later_batch_work_of_any_tenant():
    sched = Scheduler(PoolCacheManager(4096, 8, True, max_cached_cells=2048), 1, 64, 8, 8)
    resumed = make_seq(0, 8, True)
    resumed.tenant = "heavy"
    sched.add(resumed)
    run_steps(sched, 2)
    sched.preempt(resumed, keep_cached=True)
    later = make_seq(1, 8, True)
    later.tenant = "light"  # less served than heavy: fair share alone would admit it first
    sched.add(later)
    assert list(sched.waiting) == [resumed, later]
    sched.schedule()
    assert sched.running == [resumed] and list(sched.waiting) == [later]
