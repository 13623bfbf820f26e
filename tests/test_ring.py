"""Tests of the shared-memory token ring, on real shared memory and real processes."""
from __future__ import annotations

import itertools
import multiprocessing
import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from daemonkit import wait_until
from ringkit import event, publish

from cbatch.ipc.records import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    FLAG_LAST,
    MAX_TEXT_BYTES,
    NO_TOKEN,
    TokenEvent,
)
from cbatch.ipc.ring import (
    MAX_ROSTER_IDS,
    SEVERAL_REQUESTS,
    SHM_DIR,
    CrashMark,
    CrashMarks,
    RingError,
    RingOverrun,
    RingReader,
    RingRecord,
    RingWriter,
    attach_ring,
    create_ring,
)

_name_counter = itertools.count()
CHILD_TIMEOUT_S = 60.0


def unique_name() -> str:
    return f"cbring_test_{os.getpid()}_{next(_name_counter)}"


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


@pytest.fixture
def rings():
    """Factory for created/attached rings; closes them all and unlinks the created ones."""
    created, attached = [], []

    class Factory:
        @staticmethod
        def create(capacity: int = 64):
            ring = create_ring(unique_name(), capacity)
            created.append(ring)
            return ring

        @staticmethod
        def attach(name: str):
            ring = attach_ring(name)
            attached.append(ring)
            return ring

    try:
        yield Factory
    finally:
        for ring in attached + created:
            ring.close()
        for ring in created:
            ring.unlink()
            assert not os.path.exists(shm_path(ring.name))


def run_child(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run a Python snippet in a fresh interpreter (own resource tracker, own imports)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=True)


def by_request(records: list[RingRecord]) -> dict[int, list[RingRecord]]:
    grouped: dict[int, list[RingRecord]] = {}
    for record in records:
        grouped.setdefault(record.request_id, []).append(record)
    return grouped


def check_stream(records: list[RingRecord], tokens: list[int], text: bytes,
                 finish: int | None) -> None:
    """One request's complete record stream is well formed and carries tokens and text."""
    assert [r.index for r in records] == list(range(len(records)))
    assert [r.token_id for r in records if r.token_id != NO_TOKEN] == tokens
    assert b"".join(r.text for r in records) == text
    assert all(len(r.text) <= MAX_TEXT_BYTES for r in records)
    assert all(r.text for r in records if r.token_id == NO_TOKEN and not r.finish)  # a continuation carries text
    if finish is not None:
        last = records[-1]
        assert last.flags & FLAG_LAST and last.finish == finish and last.count == len(records)
        assert not any(r.flags & FLAG_LAST for r in records[:-1])


def test_round_trip_with_long_utf8_text_and_finish_only_events(rings):
    ring = rings.create(capacity=64)
    writer = RingWriter(ring)
    reader = RingReader(rings.attach(ring.name))
    for request_id in (1, 2, 3, 4):
        reader.watch(request_id)
    long_text = "héllo wörld ✓ 日本語のテキスト 🎉 ".encode() * 3  # > 3 records of 32 bytes

    next_1 = publish(writer, 1, 0, [10], b"Hel")
    assert next_1 == 1
    next_1 = publish(writer, 1, next_1, [11, 12], b"lo")
    next_1 = publish(writer, 1, next_1, [13, 14], long_text)
    next_indices = writer.publish_many([
        event(2, 0, [20], b"x" * MAX_TEXT_BYTES),
        event(3, 0, [], b"", FINISH_CANCELLED),  # finish-only, first and last
        event(4, 0, [], "ü".encode() * 20),  # text-only, 40 bytes
        event(1, next_1, [], b"", FINISH_STOP),  # finish-only
    ])
    writer.publish_many([event(2, next_indices[0], [21], b"y" * 33, FINISH_LENGTH),
                         event(4, next_indices[2], [40], b"", FINISH_STOP)])
    grouped = by_request(reader.poll())
    assert reader.poll() == []

    check_stream(grouped[1], [10, 11, 12, 13, 14], b"Hello" + long_text, FINISH_STOP)
    check_stream(grouped[2], [20, 21], b"x" * 32 + b"y" * 33, FINISH_LENGTH)
    check_stream(grouped[3], [], b"", FINISH_CANCELLED)
    check_stream(grouped[4], [40], "ü".encode() * 20, FINISH_STOP)
    assert grouped[3] == [RingRecord(3, 0, NO_TOKEN, FLAG_LAST,
                                     FINISH_CANCELLED, 1, b"")]
    # Text rides on the event's last token, then spills over; LAST lands on a continuation.
    assert [(r.token_id, r.text, r.flags) for r in grouped[2]] == [
        (20, b"x" * 32, 0), (21, b"y" * 32, 0),
        (NO_TOKEN, b"y", FLAG_LAST)]
    assert [(r.token_id, r.text) for r in grouped[1][1:3]] == [(11, b""), (12, b"lo")]
    assert grouped[1][3].text == b"" and grouped[1][4].token_id == 14
    assert b"".join(r.text for r in grouped[1]).decode() == "Hello" + long_text.decode()


def test_exact_records_of_one_event(rings):
    ring = rings.create(capacity=8)
    reader = RingReader(ring)
    reader.watch(5)
    text = bytes(range(65, 65 + 26)) * 2 + b"\x00\x00"  # 54 bytes, trailing NULs kept
    assert publish(RingWriter(ring), 5, 0, [1, 2], text, FINISH_STOP) == 3
    assert reader.poll() == [
        RingRecord(5, 0, 1, 0, 0, 0, b""),
        RingRecord(5, 1, 2, 0, 0, 0, text[:32]),
        RingRecord(5, 2, NO_TOKEN, FLAG_LAST, FINISH_STOP, 3, text[32:]),
    ]


def test_reader_gets_only_watched_requests(rings):
    ring = rings.create()
    writer = RingWriter(ring)
    reader_a, reader_b = RingReader(rings.attach(ring.name)), RingReader(ring)
    reader_a.watch(1)
    reader_b.watch(2)
    writer.publish_many([event(rid, 0, [rid * 10], b"t") for rid in (1, 2, 3)])
    assert [(r.request_id, r.token_id) for r in reader_a.poll()] == [(1, 10)]
    assert [(r.request_id, r.token_id) for r in reader_b.poll()] == [(2, 20)]
    reader_a.unwatch(1)
    publish(writer, 1, 1, [11], b"")
    assert reader_a.poll() == []


def test_reader_starts_at_current_cursor_and_writer_continues_after_restart(rings):
    ring = rings.create(capacity=16)
    publish(RingWriter(ring), 1, 0, [1], b"old")
    reader = RingReader(rings.attach(ring.name))  # starts after the old record
    reader.watch(1, next_index=1)
    restarted = RingWriter(rings.attach(ring.name))  # a new worker on the same segment
    publish(restarted, 1, 1, [2], b"new")
    assert [(r.index, r.text) for r in reader.poll()] == [(1, b"new")]
    assert ring.write_cursor == 2 and ring.heartbeat_ns > 0
    replay = RingReader(ring, start_cursor=0)
    replay.watch(1)
    assert [r.token_id for r in replay.poll()] == [1, 2]


WRITER_CHILD = """
    import random, sys
    from cbatch.ipc.records import TokenEvent
    from cbatch.ipc.ring import RingWriter, attach_ring
    name, num_tokens, with_noise = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "noise"
    ring = attach_ring(name)
    writer, rng, index = RingWriter(ring), random.Random(1), 0
    while index < num_tokens:
        # An unwatched request's record in every batch, unless the reader must be able to
        # map ring positions to indices (position == index without noise).
        events = [TokenEvent(2, [7], "noise")] if with_noise else []
        for _ in range(min(rng.randint(1, 16), num_tokens - index)):
            finish_reason = "stop" if index == num_tokens - 1 else ""
            events.append(TokenEvent(1, [index], "<%d>" % index, finish_reason, index=index))
            index += 1
        writer.publish_many(events)
    ring.close()
"""


def start_writer_child(name: str, num_tokens: int, with_noise: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER_CHILD), name,
                             str(num_tokens), "noise" if with_noise else "quiet"])


def test_writer_in_another_process_reader_gets_each_record_once_in_order(rings):
    num_tokens = 3000
    ring = rings.create(capacity=8192)  # room for every record: no overrun possible
    reader = RingReader(ring)
    reader.watch(1)
    child = start_writer_child(ring.name, num_tokens, with_noise=True)
    received: list[RingRecord] = []
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while not received or not received[-1].flags & FLAG_LAST:
            assert time.monotonic() < deadline, "writer did not finish"
            received += reader.poll()
    finally:
        assert child.wait(timeout=CHILD_TIMEOUT_S) == 0
    assert [r.token_id for r in received] == list(range(num_tokens))
    assert [r.text for r in received] == [b"<%d>" % i for i in range(num_tokens)]
    check_stream(received, list(range(num_tokens)),
                 b"".join(b"<%d>" % i for i in range(num_tokens)), FINISH_STOP)
    assert reader.poll() == []


def test_concurrent_writer_lapping_a_slow_reader_loses_and_duplicates_nothing(rings):
    """Tiny ring, fast writer, dawdling reader: every gap is reported, then recovered."""
    num_tokens = 20000
    ring = rings.create(capacity=64)
    reader = RingReader(ring)
    reader.watch(1)
    child = start_writer_child(ring.name, num_tokens, with_noise=False)
    received: list[RingRecord] = []
    num_overruns = 0
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        # The first poll comes only after the writer is two laps ahead: at least one lap
        # happens however fast this reader is.
        while ring.write_cursor < 2 * ring.capacity:
            assert time.monotonic() < deadline and child.poll() in (None, 0), "writer did not start"
            time.sleep(0.001)
        while len(received) < num_tokens:
            assert time.monotonic() < deadline, "writer did not finish"
            time.sleep(0.0002)
            try:
                received += reader.poll()
            except RingOverrun as overrun:
                num_overruns += 1
                assert overrun.request_ids == {1}
                received += overrun.records
                # The "other channel": position i of this ring is request 1's record i, and
                # everything before the reader's resynchronised cursor has been published.
                start, end = reader.next_index(1), reader.cursor
                received += [RingRecord(1, i, i, 0, 0, 0, b"<%d>" % i) for i in range(start, end)]
                reader.resume(1, end)
    finally:
        assert child.wait(timeout=CHILD_TIMEOUT_S) == 0
    assert [r.index for r in received] == list(range(num_tokens))
    assert [r.token_id for r in received] == list(range(num_tokens))
    assert [r.text for r in received] == [b"<%d>" % i for i in range(num_tokens)]
    assert reader.poll() == []
    assert num_overruns >= 1


def test_overrun_names_request_and_recovery_drops_duplicates(rings):
    ring = rings.create(capacity=8)
    writer = RingWriter(ring)
    reader = RingReader(ring)
    reader.watch(7)
    reader.watch(8)
    reader.watch(9)
    publish(writer, 9, 0, [], b"", FINISH_STOP)
    assert [r.request_id for r in reader.poll()] == [9]  # 9 is finished: cannot lose records
    for index in range(100):
        publish(writer, 7, index, [1000 + index], b"")
    with pytest.raises(RingOverrun) as caught:
        reader.poll()
    assert caught.value.request_ids == {7, 8}
    assert caught.value.records == []
    assert reader.cursor == ring.write_cursor  # resynchronised
    assert reader.next_index(7) == 0

    for index in range(100, 105):  # published while the caller recovers
        publish(writer, 7, index, [1000 + index], b"")
    assert reader.poll() == []  # held back until resume()
    reader.resume(7, 103)  # the other channel delivered indices 0..102
    reader.resume(8, 0)
    assert [r.index for r in reader.poll()] == [103, 104]  # 100..102 dropped as duplicates
    writer.publish_many([event(7, 105, [1105], b"", FINISH_STOP),
                         event(7, 103, [1103], b"")])  # a duplicate index
    assert [(r.index, r.finish) for r in reader.poll()] == [(105, FINISH_STOP)]


def test_record_overwritten_during_copy_is_an_overrun_not_data(rings):
    ring = rings.create(capacity=8)
    writer = RingWriter(ring)
    reader = RingReader(ring)
    reader.watch(1)
    publish(writer, 1, 0, [0, 1, 2, 3], b"")
    ring.seqs[2] = 2 + 1 + ring.capacity  # as if a writer one lap ahead rewrote slot 2
    with pytest.raises(RingOverrun) as caught:
        reader.poll()
    assert caught.value.request_ids == {1}
    assert [r.index for r in caught.value.records] == [0, 1]  # the intact prefix
    ring.seqs[2] = 0  # "being written"
    reader = RingReader(ring, start_cursor=0)
    reader.watch(1)
    with pytest.raises(RingOverrun) as caught:
        reader.poll()
    assert [r.index for r in caught.value.records] == [0, 1]


def test_batch_larger_than_the_ring_keeps_only_its_tail(rings):
    ring = rings.create(capacity=8)
    reader = RingReader(ring)
    reader.watch(1)
    assert publish(RingWriter(ring), 1, 0, list(range(20)), b"", FINISH_STOP) == 20
    with pytest.raises(RingOverrun) as caught:
        reader.poll()
    assert caught.value.request_ids == {1}
    tail_reader = RingReader(ring, start_cursor=12)
    tail_reader.watch(1, next_index=12)
    tail = tail_reader.poll()
    assert [r.token_id for r in tail] == list(range(12, 20))
    assert tail[-1].flags & FLAG_LAST and tail[-1].count == 20


def test_index_gap_is_reported_and_held_records_released_by_resume(rings):
    ring = rings.create(capacity=8)
    writer = RingWriter(ring)
    reader = RingReader(ring)
    reader.watch(9)
    publish(writer, 9, 3, [30], b"late")
    with pytest.raises(RingOverrun) as caught:
        reader.poll()
    assert caught.value.request_ids == {9} and reader.next_index(9) == 0
    reader.resume(9, 2)  # recovered 0..1 only: record 3 still does not follow
    with pytest.raises(RingOverrun) as caught:
        reader.poll()
    assert caught.value.request_ids == {9}
    reader.resume(9, 3)
    assert [(r.index, r.text) for r in reader.poll()] == [(3, b"late")]
    assert reader.next_index(9) == 4


@pytest.mark.parametrize("field, value", [
    (0, 0),  # magic
    (1, 1),  # layout version
    (2, 1 << 40),  # absurd capacity
    (2, 3),  # not a power of two
    (2, 0),
    (2, 1024),  # more records than the segment holds
    (3, 32),  # record size
])
def test_attach_rejects_bad_header(rings, field, value):
    ring = rings.create(capacity=8)
    ring.header[field] = value
    with pytest.raises(RingError):
        attach_ring(ring.name)


def test_crash_marks_name_the_generation_decodes_requests(rings):
    """The worker writes the request ids of the llama_decode it enters; a dead worker's marks
    say them, and are cleared for the next; a batch larger than the roster is unknown (None)."""
    ring = rings.create(capacity=8)
    worker_view = attach_ring(ring.name)
    try:
        decoding, embedding = (worker_view.decode_marker(mark) for mark in (CrashMark.DECODING, CrashMark.EMBEDDING))
        sampling = worker_view.marker(CrashMark.SAMPLING)
        decoding([7, 3, 12])
        marks = ring.take_crash_marks()
        assert marks.is_decoding and marks.decoding_ids == (7, 3, 12) and marks.request_ids == ()
        decoding([5])
        decoding(())  # left llama_decode
        sampling(9)
        assert ring.take_crash_marks() == CrashMarks((9,), False, ())
        sampling(SEVERAL_REQUESTS)  # the sampling's joint mask fill: several requests, none named
        assert ring.take_crash_marks() == CrashMarks((), False, (), is_several=True)
        embedding([1, 2])  # embed ids are of another kind: the roster keeps generation ids only
        assert ring.take_crash_marks() == CrashMarks((), True, ())
        decoding(range(1, MAX_ROSTER_IDS + 2))
        assert ring.take_crash_marks() == CrashMarks((), True, None)
        assert ring.take_crash_marks() == CrashMarks((), False, ())
    finally:
        worker_view.close()


@pytest.mark.parametrize("size_bytes", [0, 10])
def test_attach_rejects_foreign_tiny_segment(size_bytes):
    name = unique_name()
    fd = os.open(shm_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size_bytes)
        with pytest.raises(RingError):
            attach_ring(name)
    finally:
        os.close(fd)
        os.unlink(shm_path(name))


def test_missing_or_invalid_names_and_bad_capacity_raise_ring_error(rings):
    with pytest.raises(RingError):
        attach_ring(unique_name())
    with pytest.raises(RingError):
        attach_ring("../etc/passwd")
    for capacity in (0, 3, 1 << 30):
        with pytest.raises(RingError):
            create_ring(unique_name(), capacity)
    ring = rings.create(capacity=8)
    with pytest.raises(RingError):
        create_ring(ring.name, 8)  # exists already
    with pytest.raises(RingError):
        rings.attach(ring.name).unlink()  # only the creator unlinks


@pytest.mark.parametrize("field, value", [("text_len", 200), ("flags", 0x80), ("finish", 9),
                                          ("count", 77)])
def test_corrupt_record_raises_ring_error(rings, field, value):
    ring = rings.create(capacity=8)
    reader = RingReader(ring)
    reader.watch(1)
    publish(RingWriter(ring), 1, 0, [5], b"abc", FINISH_STOP)
    ring.records[field][0] = value
    with pytest.raises(RingError) as caught:
        reader.poll()
    assert not isinstance(caught.value, RingOverrun)


@pytest.mark.parametrize("bad_event", [
    TokenEvent(1, [1], "", "no such reason"),
    TokenEvent(1, [1], b"bytes, not text"),
    TokenEvent(1, [1 << 40], ""),
    TokenEvent(-1, [1], ""),
    TokenEvent(1 << 64, [1], ""),
    TokenEvent(1, [1], "", index=1 << 32),
    TokenEvent(1, [1], "", "stop", index=(1 << 32) - 1),  # its count, index + 1, is out of range
])
def test_invalid_event_publishes_nothing(rings, bad_event):
    ring = rings.create(capacity=8)
    with pytest.raises(RingError):
        RingWriter(ring).publish_many([event(2, 0, [1], b"ok"), bad_event])
    assert ring.write_cursor == 0


ATTACH_CHILD = """
    import sys
    from multiprocessing import resource_tracker
    from cbatch.ipc.records import TokenEvent
    from cbatch.ipc.ring import RingWriter, attach_ring
    ring = attach_ring(sys.argv[1])
    RingWriter(ring).publish_many([TokenEvent(1, [1], "child")])
    if sys.argv[2] == "close":
        ring.close()
    resource_tracker.ensure_running()  # what would unlink a registered segment once we exit
    print(resource_tracker._resource_tracker._pid)
"""


def test_segment_survives_a_child_that_attached_and_exited(rings):
    ring = rings.create(capacity=8)
    assert stat.S_IMODE(os.stat(shm_path(ring.name)).st_mode) == 0o600
    for how in ("close", "leave-open"):
        tracker_pid = int(run_child(ATTACH_CHILD, ring.name, how).stdout)
        # The child's resource tracker unlinks what the child registered once the child
        # has exited, and then exits itself: after that, the segment is still there.
        wait_until(lambda: not os.path.exists(f"/proc/{tracker_pid}"), timeout_s=60.0)
        assert os.path.exists(shm_path(ring.name))
    assert ring.write_cursor == 2
    assert rings.attach(ring.name).write_cursor == 2


def test_plain_shared_memory_attach_would_lose_the_segment():
    """Control for the test above: Python's own attach path unlinks at the child's exit."""
    ring = create_ring(unique_name(), 8)
    try:
        run_child("""
            import sys
            from multiprocessing import shared_memory
            shared_memory.SharedMemory(sys.argv[1]).close()
        """, ring.name)
        wait_until(lambda: not os.path.exists(shm_path(ring.name)), timeout_s=60.0)
    finally:
        ring.close()
        ring.unlink()  # tolerates the segment being gone already


def _spawned_attach(name: str) -> None:
    with attach_ring(name) as ring:
        publish(RingWriter(ring), 1, 0, [1], b"spawned")


def test_spawned_child_sharing_the_tracker_leaves_the_segment_alone(rings):
    ring = rings.create(capacity=8)
    reader = RingReader(ring)
    reader.watch(1)
    child = multiprocessing.get_context("spawn").Process(target=_spawned_attach,
                                                         args=(ring.name,))
    child.start()
    child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == 0
    assert os.path.exists(shm_path(ring.name))
    assert [r.text for r in reader.poll()] == [b"spawned"]


def test_unlink_leaves_nothing_behind_and_context_manager_closes():
    with create_ring(None, 8) as ring:
        name = ring.name
        assert os.path.exists(shm_path(name))
        assert stat.S_IMODE(os.stat(shm_path(name)).st_mode) == 0o600
        with attach_ring(name) as attached:
            assert attached.capacity == 8
        ring.unlink()
        assert not os.path.exists(shm_path(name))
    assert ring.header is None  # closed
    with pytest.raises(RingError):
        attach_ring(name)
