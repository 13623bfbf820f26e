"""Scheduler policy without a model: admission, token budget, chunked prefill, slots."""

import pytest

from cbatch.errors import CbatchError, QUEUE_FULL
from cbatch.params import SamplingParams
from cbatch.workers.scheduler import Scheduler
from cbatch.workers.sequence import Sequence, SequenceStatus


def make_seq(request_id, num_prompt):
    return Sequence(request_id, list(range(num_prompt)), SamplingParams())


def feed(chunks):
    """What the engine does after a decode: cache the chunk, sample if it asked to."""
    for chunk in chunks:
        chunk.seq.num_cached += chunk.num_tokens
        if chunk.wants_logits:
            chunk.seq.output_ids.append(7)


def test_admits_fifo_up_to_slots_and_queues_the_rest():
    sched = Scheduler(num_slots=2, max_batch_tokens=64, max_queue=8)
    seqs = [make_seq(i, 4) for i in range(5)]
    for s in seqs:
        sched.add(s)
    chunks = sched.schedule()
    assert [c.seq.request_id for c in chunks] == [0, 1]
    assert sorted(s.slot for s in seqs[:2]) == [0, 1]
    assert all(s.status is SequenceStatus.WAITING for s in seqs[2:])
    assert list(sched.waiting) == seqs[2:]


def test_queue_full_rejects_with_code():
    sched = Scheduler(num_slots=1, max_batch_tokens=8, max_queue=2)
    sched.add(make_seq(0, 1))
    sched.add(make_seq(1, 1))
    with pytest.raises(CbatchError) as err:
        sched.add(make_seq(2, 1))
    assert err.value.code == QUEUE_FULL and "--max-queue" in err.value.message


def test_decode_tokens_first_then_prefill_chunks_within_budget():
    sched = Scheduler(num_slots=4, max_batch_tokens=16, max_queue=8)
    short = make_seq(0, 3)
    sched.add(short)
    feed(sched.schedule())  # short prefilled, now generating
    long_a, long_b = make_seq(1, 40), make_seq(2, 40)
    sched.add(long_a)
    sched.add(long_b)
    chunks = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [(0, 1), (1, 15)]
    assert chunks[0].wants_logits and not chunks[1].wants_logits
    assert sum(c.num_tokens for c in chunks) == 16
    feed(chunks)
    chunks = sched.schedule()
    # long_a continues from where its first chunk ended; long_b starts once there is room.
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in chunks] == [(0, 4, 1), (1, 15, 15)]
    feed(chunks)
    chunks = sched.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in chunks] == [(0, 5, 1), (1, 30, 10), (2, 0, 5)]
    assert chunks[1].wants_logits and not chunks[2].wants_logits


def test_finished_slot_is_reused_by_the_next_waiting_request():
    sched = Scheduler(num_slots=1, max_batch_tokens=8, max_queue=8)
    first, second = make_seq(0, 2), make_seq(1, 2)
    sched.add(first)
    sched.add(second)
    feed(sched.schedule())
    slot = sched.finish(first)
    assert slot == 0 and first.status is SequenceStatus.FINISHED and first.slot is None
    chunks = sched.schedule()
    assert [c.seq for c in chunks] == [second] and second.slot == 0


def test_finishing_a_waiting_request_frees_nothing():
    sched = Scheduler(num_slots=1, max_batch_tokens=8, max_queue=8)
    running, queued = make_seq(0, 2), make_seq(1, 2)
    sched.add(running)
    sched.add(queued)
    sched.schedule()
    assert sched.finish(queued) is None
    assert not sched.waiting and sched.running == [running]


def test_preempt_newest_requeues_it_at_the_head_for_recompute():
    sched = Scheduler(num_slots=2, max_batch_tokens=32, max_queue=8)
    old, new, queued = make_seq(0, 3), make_seq(1, 3), make_seq(2, 3)
    for s in (old, new, queued):
        sched.add(s)
    feed(sched.schedule())
    seq, slot = sched.preempt_newest()
    assert seq is new and slot == 1 and new.slot is None
    assert new.num_cached == 0 and new.output_ids == [7]
    assert list(sched.waiting) == [new, queued]
    chunks = sched.schedule()
    # Recompute covers prompt + the token already sampled, then samples the next one.
    assert [(c.seq.request_id, c.start, c.num_tokens, c.wants_logits) for c in chunks] == [
        (0, 3, 1, True), (1, 0, 4, True)
    ]
