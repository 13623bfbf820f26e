"""Paused sequences (their clients read slower than they generate) give their slots to
waiting requests once paused past the parking bound, and the scheduler does nothing,
rather than step empty batches, while the queue can only wait for them. No model here."""

import math

import numpy as np

from cbatch.params import SamplingParams
from cbatch.workers.engine.kv.base import BLOCK_TOKENS
from cbatch.workers.engine.kv.pool import PoolCacheManager
from cbatch.workers.engine.sched.scheduler import Scheduler
from cbatch.workers.engine.sched.step_batch import BatchSpan
from cbatch.workers.engine.sequence import SeqStatus, Sequence
from cbatch.workers.engine.vision import ImageSpan

PARK_AFTER_S = 30.0


class Clock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make_seq(request_id, num_prompt=40):  # longer than a cache block (BLOCK_TOKENS)
    return Sequence(request_id, list(range(1000 * request_id, 1000 * request_id + num_prompt)), SamplingParams())


def running_pair():
    """Two slots, both taken by sequences that have sampled a token each."""
    clock = Clock()
    kv = PoolCacheManager(4096, 8, True, max_cached_cells=2048)
    sched = Scheduler(kv, 2, 128, 8, 8, park_after_s=PARK_AFTER_S, clock=clock)
    seqs = [make_seq(0), make_seq(1)]
    for seq in seqs:
        sched.add(seq)
    step(sched)
    return sched, clock, seqs


def step(sched):
    spans = sched.schedule()
    for span in spans:
        sched.on_computed(span)
        if span.wants_logits:
            span.seq.output_ids.append(7)
    return spans


def test_paused_sequences_keep_their_slots_while_nobody_waits():
    sched, clock, seqs = running_pair()
    for seq in seqs:
        sched.set_paused(seq, True)
    clock.now_s += 10 * PARK_AFTER_S
    assert not sched.has_work and sched.idle_wait_s == math.inf
    assert step(sched) == [] and sched.running == seqs and not sched.parked


def test_a_waiting_request_is_admitted_once_a_paused_one_passes_the_bound():
    sched, clock, (first, second) = running_pair()
    sched.set_paused(first, True)
    clock.now_s += 1
    sched.set_paused(second, True)
    newcomer = make_seq(2)
    sched.add(newcomer)
    assert step(sched) == []  # nothing can run yet: no empty steps until the first parking is due
    assert not sched.has_work and sched.idle_wait_s == PARK_AFTER_S - 1  # the loop waits that long at most
    clock.now_s += PARK_AFTER_S - 1.5
    assert not sched.has_work and sched.idle_wait_s == 0.5
    clock.now_s += 0.5
    assert sched.has_work
    spans = step(sched)
    # The longest paused gives its slot; the other keeps its own (one slot was wanted).
    assert [span.seq for span in spans] == [newcomer]
    assert first.status is SeqStatus.PARKED and first.seq_id is None and sched.parked == [first]
    assert second in sched.running and second.status is SeqStatus.DECODING
    assert sched.num_parks == 1


def test_a_parked_sequence_resumes_from_its_kept_prefix_when_its_client_catches_up():
    sched, clock, (first, second) = running_pair()
    sched.set_paused(first, True)
    clock.now_s += PARK_AFTER_S
    newcomer, later = make_seq(2), make_seq(3)
    sched.add(newcomer)
    step(sched)
    assert first.status is SeqStatus.PARKED
    num_tokens = first.num_tokens
    sched.set_paused(first, False)
    sched.add(later)  # arrived after: the parked one goes first
    assert list(sched.waiting) == [first, later]
    sched.finish(newcomer, keep_cached=True)
    spans = sched.schedule()
    assert first in sched.running and first.num_tokens == num_tokens
    # Its prompt and output were kept in the prefix cache by whole blocks: only the rest is computed.
    [(start, num_computed)] = [(span.start, span.num_tokens) for span in spans if span.seq is first]
    assert start == BLOCK_TOKENS * (num_tokens // BLOCK_TOKENS) and start + num_computed == num_tokens
    assert first.num_paused_s == 0.0  # a new bound for the new admission


def test_pauses_add_up_so_a_reader_that_takes_a_little_now_and_then_is_parked_too():
    sched, clock, (first, second) = running_pair()
    sched.add(make_seq(2))
    for _ in range(4):  # paused most of the time, going on for a moment now and then
        sched.set_paused(first, True)
        clock.now_s += PARK_AFTER_S / 4
        sched.set_paused(first, False)
        step(sched)
        assert first in sched.running
    sched.set_paused(first, True)
    step(sched)
    assert first.status is SeqStatus.PARKED


def test_a_parked_sequence_past_its_deadline_or_cancelled_ends_holding_nothing():
    sched, clock, (first, second) = running_pair()
    first.deadline_s = clock.now_s + 2 * PARK_AFTER_S
    sched.deadlines.add(first)
    sched.set_paused(first, True)
    sched.set_paused(second, True)
    clock.now_s += PARK_AFTER_S
    sched.add(make_seq(2))
    sched.add(make_seq(3))
    step(sched)
    assert sched.parked == [first, second] or sched.parked == [second, first]
    clock.now_s += PARK_AFTER_S
    queued, started = sched.take_expired(clock.now_s)
    assert queued == [] and started == [first]
    sched.finish(first, keep_cached=True)
    sched.finish(second, keep_cached=True)
    assert first.status is second.status is SeqStatus.FINISHED and not sched.parked


def test_a_sequence_preempted_while_paused_is_parked_rather_than_admitted():
    sched, clock, (first, second) = running_pair()
    sched.set_paused(first, True)
    sched.preempt(first, keep_cached=True)
    step(sched)
    assert first.status is SeqStatus.PARKED and sched.running == [second]
    sched.set_paused(first, False)
    step(sched)
    assert first in sched.running


def test_the_queue_is_looked_at_again_once_a_sequence_that_ran_pauses():
    """A step with nothing to compute while a running sequence is not paused (it waits at
    an image, written beside the token batch) must not leave the scheduler asleep: once that
    sequence pauses, its parking is due as for any other."""
    clock = Clock()
    kv = PoolCacheManager(4096, 8, True, max_cached_cells=2048)
    sched = Scheduler(kv, 1, 128, 8, 8, park_after_s=PARK_AFTER_S, clock=clock)
    first = make_seq(0)
    first.images = (ImageSpan(0, np.zeros((8, 4), np.float32)),)
    sched.add(first)
    sched.add(make_seq(1))
    assert sched.schedule() == []  # at its image: no text to compute this step
    assert sched.has_work
    sched.on_computed(BatchSpan(first, 0, 8))  # the image written
    step(sched)
    step(sched)
    sched.set_paused(first, True)
    clock.now_s += PARK_AFTER_S
    assert sched.has_work
    step(sched)
    assert first.status is SeqStatus.PARKED


def test_paused_sequences_that_fill_a_unified_pool_are_parked_for_a_request_with_a_free_slot():
    clock = Clock()
    kv = PoolCacheManager(96, 8, True, max_cached_cells=0)
    sched = Scheduler(kv, 2, 128, 8, 8, park_after_s=PARK_AFTER_S, clock=clock)
    first = make_seq(0, num_prompt=80)
    sched.add(first)
    step(sched)
    sched.set_paused(first, True)
    newcomer = make_seq(1)  # a slot is free, the cells are not
    sched.add(newcomer)
    assert step(sched) == [] and newcomer.status is SeqStatus.WAITING and not sched.has_work
    clock.now_s += PARK_AFTER_S
    assert sched.has_work
    step(sched)
    assert first.status is SeqStatus.PARKED and newcomer in sched.running

