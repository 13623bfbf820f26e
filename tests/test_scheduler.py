"""Scheduler policy without a model: admission, token budget, chunked prefill, KV ids,
preemption, and waiting for a prefix another sequence is computing."""

import pytest

from cbatch.errors import QUEUE_FULL, CbatchError
from cbatch.params import SamplingParams
from cbatch.workers.engine.kv.base import BLOCK_TOKENS
from cbatch.workers.engine.kv.pool import PoolCacheManager
from cbatch.workers.engine.sched.scheduler import Scheduler
from cbatch.workers.engine.sequence import Sequence


def make_seq(request_id, num_prompt, first_token=None):
    # Distinct first tokens unless asked: prompts sharing a block would share KV.
    start = 1000 * request_id if first_token is None else first_token
    return Sequence(request_id, list(range(start, start + num_prompt)), SamplingParams())


def Sched(num_slots, max_batch_tokens, max_queue, num_cells=4096, prefix_cache=True, max_batch_queue=None):
    kv = PoolCacheManager(num_cells, 4 * num_slots, prefix_cache, max_cached_cells=num_cells // 2)
    return Scheduler(kv, num_slots, max_batch_tokens, max_queue,
                     max_queue if max_batch_queue is None else max_batch_queue)


def feed(sched, chunks):
    """What the engine does after a decode: the chunk is computed, sample if it asked to."""
    for chunk in chunks:
        sched.on_computed(chunk)
        if chunk.wants_logits:
            chunk.seq.output_ids.append(7)


def test_admits_fifo_up_to_slots_and_queues_the_rest():
    sched = Sched(num_slots=2, max_batch_tokens=64, max_queue=8)
    seqs = [make_seq(i, 4) for i in range(5)]
    for s in seqs:
        sched.add(s)
    chunks = sched.schedule()
    assert [c.seq.request_id for c in chunks] == [0, 1]
    assert sorted(s.seq_id for s in seqs[:2]) == [0, 1]
    assert all(s.seq_id is None for s in seqs[2:])
    assert list(sched.waiting) == seqs[2:]


def test_queue_full_rejects_with_code():
    sched = Sched(num_slots=1, max_batch_tokens=8, max_queue=2)
    sched.add(make_seq(0, 1))
    sched.add(make_seq(1, 1))
    sched.add(make_seq(2, 1))  # arrived before a step admitted any: one takes the free slot
    with pytest.raises(CbatchError) as err:
        sched.add(make_seq(3, 1))
    assert err.value.code == QUEUE_FULL and "--max-queue" in err.value.message
    sched.schedule()
    assert len(sched.running) == 1 and len(sched.waiting) == 2
    with pytest.raises(CbatchError):  # the slot is taken now: the queue alone is left
        sched.add(make_seq(4, 1))


def test_decode_tokens_first_then_prefill_chunks_within_budget():
    sched = Sched(num_slots=4, max_batch_tokens=16, max_queue=8)
    short = make_seq(0, 3)
    sched.add(short)
    feed(sched, sched.schedule())  # short prefilled, now generating
    long_a, long_b = make_seq(1, 40), make_seq(2, 40)
    sched.add(long_a)
    sched.add(long_b)
    chunks = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [(0, 1), (1, 15)]
    assert chunks[0].wants_logits and not chunks[1].wants_logits
    assert sum(c.num_tokens for c in chunks) == 16
    feed(sched, chunks)
    chunks = sched.schedule()
    # long_a continues from where its first chunk ended; long_b starts once there is room.
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in chunks] == [(0, 4, 1), (1, 15, 15)]
    feed(sched, chunks)
    chunks = sched.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in chunks] == [(0, 5, 1), (1, 30, 10), (2, 0, 5)]
    assert chunks[1].wants_logits and not chunks[2].wants_logits


def test_a_finished_sequence_frees_its_running_place_for_the_next_waiting_request():
    sched = Sched(num_slots=1, max_batch_tokens=8, max_queue=8)
    first, second = make_seq(0, 2), make_seq(1, 2)
    sched.add(first)
    sched.add(second)
    feed(sched, sched.schedule())
    sched.finish(first, keep_cached=False)
    assert first.seq_id is None and sched.kv.num_cells_used == 0
    chunks = sched.schedule()
    assert [c.seq for c in chunks] == [second] and second.seq_id is not None


def test_finishing_a_waiting_request_frees_nothing():
    sched = Sched(num_slots=1, max_batch_tokens=8, max_queue=8)
    running, queued = make_seq(0, 2), make_seq(1, 2)
    sched.add(running)
    sched.add(queued)
    sched.schedule()
    used = sched.kv.num_cells_used
    sched.finish(queued, keep_cached=True)
    assert not sched.waiting and sched.running == [running] and sched.kv.num_cells_used == used


def test_preempt_for_cells_requeues_it_at_the_head_for_recompute():
    sched = Sched(num_slots=2, max_batch_tokens=32, max_queue=8)
    old, new, queued = make_seq(0, 3), make_seq(1, 3), make_seq(2, 3)
    for s in (old, new, queued):
        sched.add(s)
    feed(sched, sched.schedule())
    seq = sched.preempt_for_cells()
    assert seq is new and new.seq_id is None
    assert new.num_cached == 0 and new.output_ids == [7]
    assert list(sched.waiting) == [new, queued]
    chunks = sched.schedule()
    # Recompute covers prompt + the token already sampled, then samples the next one.
    assert [(c.seq.request_id, c.start, c.num_tokens, c.wants_logits) for c in chunks] == [
        (0, 3, 1, True), (1, 0, 4, True)
    ]


def test_a_prompt_waits_while_another_sequence_computes_the_prefix_it_would_reuse():
    sched = Sched(num_slots=4, max_batch_tokens=40, max_queue=8)
    shared = 3 * BLOCK_TOKENS
    first = Sequence(0, list(range(shared)) + [900, 901], SamplingParams())
    second = Sequence(1, list(range(shared)) + [902, 903], SamplingParams())
    other = make_seq(2, 5)
    for s in (first, second, other):
        sched.add(s)
    chunks = sched.schedule()
    # second is passed over, keeping its place; other (nothing shared) is admitted.
    assert sched.running == [first, other] and list(sched.waiting) == [second]
    assert [(c.seq, c.num_tokens) for c in chunks] == [(first, 35), (other, 5)]  # the fewest left first
    feed(sched, chunks)  # first has computed 35 tokens: two whole blocks are indexed
    chunks = sched.schedule()
    assert second not in [c.seq for c in chunks], "its third block is still being computed"
    feed(sched, chunks)
    chunks = sched.schedule()
    assert second in sched.running and second.num_cached == shared
    assert sched.kv.num_tokens_reused == shared


def test_out_of_cells_a_generating_sequence_preempts_the_newest():
    sched = Sched(num_slots=2, max_batch_tokens=64, max_queue=8, num_cells=40, prefix_cache=False)
    old, new = make_seq(0, 19), make_seq(1, 19)
    sched.add(old)
    sched.add(new)
    feed(sched, sched.schedule())  # 38 of 40 cells reserved; each now needs one more, then another
    feed(sched, sched.schedule())
    assert sched.kv.num_cells_used == 40
    chunks = sched.schedule()
    assert [c.seq for c in chunks] == [old] and list(sched.waiting) == [new] and new.num_cached == 0
    assert sched.kv.num_cells_used == 21


def test_a_sequence_states_where_it_is():
    from cbatch.workers.engine.sequence import SeqStatus

    sched = Sched(num_slots=1, max_batch_tokens=8, max_queue=8, prefix_cache=False)
    seq, queued = make_seq(0, 12), make_seq(1, 4)
    sched.add(seq)
    sched.add(queued)
    assert seq.status is queued.status is SeqStatus.WAITING
    feed(sched, sched.schedule())  # 8 of 12 prompt tokens
    assert seq.status is SeqStatus.PREFILLING and queued.status is SeqStatus.WAITING
    feed(sched, sched.schedule())  # the last 4: sampled
    assert seq.status is SeqStatus.DECODING
    assert sched.preempt_for_cells() is seq and seq.status is SeqStatus.WAITING and seq.seq_id is None
    sched.finish(queued, keep_cached=False)
    assert queued.status is SeqStatus.FINISHED and list(sched.waiting) == [seq]


def test_a_passed_over_prompt_keeps_a_slot_and_is_not_passed_over_for_nothing():
    """One slot free beside the prefix's computer: the passed-over request keeps it (a later
    arrival waits). With per-sequence streams a prefix too short to be worth a stream copy
    is never waited for: the request is admitted at once and computes it itself."""
    from cbatch.workers.engine.kv.streams import StreamCacheManager

    shared = 3 * BLOCK_TOKENS
    pool = Sched(num_slots=2, max_batch_tokens=40, max_queue=8)
    streams = Scheduler(StreamCacheManager(2, 1024, True), 2, 40, 8, 8)
    for sched, reuses in ((pool, True), (streams, False)):
        first = Sequence(0, list(range(shared)) + [900, 901], SamplingParams())
        second = Sequence(1, list(range(shared)) + [902, 903], SamplingParams())
        later = make_seq(2, 5)
        for s in (first, second, later):
            sched.add(s)
        sched.schedule()
        if reuses:
            assert sched.running == [first] and list(sched.waiting) == [second, later]
        else:
            assert sched.running == [first, second] and list(sched.waiting) == [later]


def test_interactive_requests_are_admitted_ahead_of_queued_batch_ones_in_their_own_order():
    sched = Sched(num_slots=1, max_batch_tokens=64, max_queue=8)
    running = make_seq(0, 4)
    sched.add(running)
    feed(sched, sched.schedule())
    batch = [make_seq(i, 4) for i in (1, 2, 3)]
    interactive = [make_seq(i, 4) for i in (4, 5)]
    for seq in batch:
        seq.is_batch = True
    for seq in (batch[0], batch[1], interactive[0], batch[2], interactive[1]):
        sched.add(seq)
    assert list(sched.waiting) == [*interactive, *batch]
    admitted = []
    for _ in range(len(batch) + len(interactive)):
        sched.finish(sched.running[0], keep_cached=False)
        sched.schedule()
        admitted.append(sched.running[0].request_id)
    assert admitted == [4, 5, 1, 2, 3]
