"""The scheduler's waiting queue without a model: each priority's own room, a deadline heap
that forgets ended requests, and a mass expiry in one pass."""

import time

import pytest
from enginekit import collect, submit
from fakerunner import FakeRunner

from cbatch.config import EngineConfig
from cbatch.errors import INVALID_CONFIG, QUEUE_FULL, CbatchError
from cbatch.params import SamplingParams
from cbatch.workers.daemon.flags import config_from_args, make_parser
from cbatch.workers.engine.engine import Engine
from cbatch.workers.engine.kv.pool import PoolCacheManager
from cbatch.workers.engine.sched.scheduler import Scheduler
from cbatch.workers.engine.sched.waiting_queue import MIN_STALE_DEADLINES
from cbatch.workers.engine.sequence import SeqStatus, Sequence

WEEK_S = 604800


class ComparedSequence(Sequence):
    """A Sequence that counts how often it is compared with another: a search of the queue
    (deque.remove, list.index, `in`) compares one sequence with the ones before it."""

    num_comparisons = 0
    __hash__ = Sequence.__hash__

    def __eq__(self, other):
        ComparedSequence.num_comparisons += 1
        return self is other


def make_seq(request_id: int, is_batch: bool = False, deadline_s: float = float("inf"), cls=Sequence) -> Sequence:
    prompt = list(range(1000 * request_id, 1000 * request_id + 4))
    return cls(request_id, prompt, SamplingParams(), is_batch=is_batch, deadline_s=deadline_s)


def make_scheduler(num_slots: int, max_queue: int, max_batch_queue: int) -> Scheduler:
    kv = PoolCacheManager(1 << 20, 4 * num_slots, True, max_cached_cells=1024)
    return Scheduler(kv, num_slots, 64, max_queue, max_batch_queue)


def test_each_priority_fills_only_its_own_room_and_the_error_names_its_setting():
    sched = make_scheduler(num_slots=1, max_queue=1, max_batch_queue=3)
    batch = [make_seq(i, is_batch=True) for i in range(4)]  # the slot + 3 waiting
    for seq in batch:
        sched.add(seq)
    with pytest.raises(CbatchError) as err:
        sched.add(make_seq(4, is_batch=True))
    assert err.value.code == QUEUE_FULL and "--max-batch-queue" in err.value.message and "batch" in err.value.message
    sched.schedule()  # a batch sequence takes the slot; the interactive room is untouched
    interactive = [make_seq(i) for i in (5, 6)]  # --parallel + --max-queue of them
    for seq in interactive:
        sched.add(seq)
    with pytest.raises(CbatchError) as err:
        sched.add(make_seq(7))
    assert err.value.code == QUEUE_FULL and "--max-queue" in err.value.message and "interactive" in err.value.message
    assert list(sched.waiting) == [*interactive, *batch[1:]]
    sched.finish(sched.running[0], keep_cached=False)  # an ended batch sequence frees a batch place
    sched.add(make_seq(8, is_batch=True))
    with pytest.raises(CbatchError):
        sched.add(make_seq(9))


def _engine_config(*flags: str) -> EngineConfig:
    return config_from_args(make_parser().parse_args(["--endpoint", "ipc:///tmp/unused.sock", *flags])).engine


def test_the_batch_room_is_as_the_interactive_one_unless_set_and_a_bad_one_names_its_flag():
    assert _engine_config("--max-queue", "7").max_in_flight == (4 + 7, 4 + 7)
    assert _engine_config("--max-queue", "7", "--max-batch-queue", "0").max_in_flight == (4 + 7, 4)
    with pytest.raises(CbatchError) as err:
        _engine_config("--max-batch-queue", "20000")
    assert err.value.code == INVALID_CONFIG
    assert err.value.message == "--max-batch-queue must be in [0, 16384], got 20000"


def test_the_deadline_heap_holds_no_entry_for_long_ended_requests():
    config = EngineConfig(parallel=4, ctx_size=1024, batch_size=64, max_queue=64)
    engine = Engine(config, FakeRunner(1024, 4, config.num_seq_ids, unified=config.kv_unified))
    results, num_requests = {}, 5 * MIN_STALE_DEADLINES
    most_entries = 0
    for at in range(0, num_requests, 32):
        for _ in range(32):
            submit(engine, {"prompt": "ab", "max_tokens": 1, "temperature": 0, "timeout": WEEK_S})
        while engine.has_work:
            collect(results, engine.step())
        most_entries = max(most_entries, engine.scheduler.deadlines.num_entries)
    assert len(results) == num_requests and all(r.finish_reason == "length" for r in results.values())
    # Before, every finished request stayed in the heap until its deadline: 5 x the bound.
    assert most_entries <= MIN_STALE_DEADLINES


def test_a_reused_request_id_expires_at_its_own_deadline():
    sched = make_scheduler(num_slots=1, max_queue=4, max_batch_queue=4)
    first = make_seq(1, deadline_s=10.0)
    sched.add(first)
    sched.drop_waiting([first])  # cancelled long before its deadline
    again = make_seq(1, deadline_s=20.0)  # the same id, a new request
    sched.add(again)
    assert sched.take_expired(15.0) == ([], [])
    assert sched.take_expired(20.0) == ([again], [])
    assert again.status is SeqStatus.FINISHED and not sched.waiting and not sched.has_work


def test_thousands_expiring_at_once_leave_the_queue_without_a_search_each():
    num_queued = 3000
    sched = make_scheduler(num_slots=1, max_queue=num_queued, max_batch_queue=num_queued)
    now_s = time.monotonic()
    seqs = [make_seq(i, is_batch=i % 2 == 1, deadline_s=now_s + 1, cls=ComparedSequence) for i in range(num_queued + 1)]
    for seq in seqs:
        sched.add(seq)
    sched.schedule()  # one runs, the rest wait
    running = sched.running[0]
    ComparedSequence.num_comparisons = 0
    queued, started = [], []
    while len(queued) + len(started) < num_queued + 1:  # a bounded number each pass
        queued_now, started_now = sched.take_expired(now_s + 1)
        queued += queued_now
        started += started_now
    # One search of the queue per expiry compared millions of pairs (2.8 million, measured).
    assert ComparedSequence.num_comparisons == 0
    assert len(queued) == num_queued and started == [running]
    assert not sched.waiting and all(seq.status is SeqStatus.FINISHED for seq in queued)
    assert sched.deadlines.num_entries == 0
    sched.finish(running, keep_cached=False)
    for i in range(2 * num_queued + 2):  # every place in both rooms is free again
        sched.add(make_seq(10_000 + i, is_batch=i % 2 == 1))
