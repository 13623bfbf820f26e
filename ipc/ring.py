"""Shared-memory token ring: one decode worker publishes sampled tokens, many local readers
each pick the records of their own request ids.

One concern: the writer and the readers share one memory-ordering contract (below), and
each side is only correct against the other's exact order of loads and stores, so they are
read and changed together.

Layout (little-endian; one segment per decode worker, created by the supervisor so that it
survives a worker restart):
  header   4096 bytes = 512 x uint64: magic, layout_version, capacity (records, power of
           two), record_size (bytes), write_cursor (records ever published, monotonic),
           heartbeat_ns (writer's time.monotonic_ns(), system-wide on Linux), then the crash
           marks (CrashMark: one per marking thread of the worker), zeros up to field 16,
           then the roster: the request ids of the generation llama_decode that runs (up to
           MAX_ROSTER_IDS; its mark holds how many).
  records  capacity x 64 bytes (RECORD_DTYPE). The record published at cursor position p
           lives in slot p % capacity and carries seq = p + 1 (0: never written, or being
           rewritten right now).

Memory-ordering invariant (one writer, any number of readers, no locks):
  writer: for the slots of a batch store seq = 0, then the other fields, then seq = p + 1;
          only after all records of the batch store write_cursor.
  reader: load write_cursor W, copy records [cursor, W), then check both the copied seq and
          a fresh load of each slot's seq against p + 1. A slot that a writer one lap ahead
          touched during the copy fails the check (the writer zeroed seq before touching the
          body), so it is reported as an overrun and never returned as data.
  Platform assumption: x86-64 TSO (stores become visible in program order, loads are not
  reordered with other loads); CPython/numpy finish one statement's stores before the next
  statement's; aligned 8-byte loads/stores (seq, write_cursor) are single instructions and
  hence atomic; batches are far below memcpy's non-temporal-store threshold (NT stores are
  weakly ordered). On weakly ordered CPUs (ARM, POWER) this is not enough: the writer needs a
  release fence before the seq stores and before the write_cursor store, the reader an
  acquire fence after loading write_cursor and before re-loading seq (e.g. a tiny C helper
  calling atomic_thread_fence); numpy offers no fences. So the ring is offered only where
  is_ring_ordered() holds; elsewhere the front-end relays every client's records over
  ZeroMQ, the path remote clients take.

Overrun recovery contract: the writer never waits, so a slow reader can be lapped. Then
RingReader.poll raises RingOverrun instead of silently losing or duplicating records:
  * exc.records: the records validated before the gap, in order; use them as poll()'s result.
  * exc.request_ids: watched, unfinished requests that may have lost records. The reader has
    already moved its cursor to the current write_cursor, and from now on holds back (does not
    return) ring records of these ids.
  * For each such id the caller fetches records [reader.next_index(id), ...) over another
    channel, then calls reader.resume(id, next_index) with 1 + the last index it recovered.
    Held and later ring records with a smaller index are dropped as duplicates; the others are
    returned by the next poll(). If they still do not start at next_index, the next poll
    raises RingOverrun for that id again.
  The same happens when a watched request's record arrives with index > next_index (e.g. the
  request was watched after its first records had been published).

Resource tracker: attach_ring maps /dev/shm/<name> itself instead of using SharedMemory. In
Python 3.11 SharedMemory(name) registers the segment with the resource tracker as if this
process owned it, and the tracker unlinks it when this non-creating process exits, destroying
the ring under the supervisor. Unregistering right after attaching is no cure either:
multiprocessing children share their parent's tracker, so that would also drop the creator's
registration. Only create_ring uses SharedMemory, whose registration is wanted there: the
segment is unlinked if the supervisor dies without unlink().
"""
from __future__ import annotations

import enum
import mmap
import os
import platform
import re
import struct
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Callable, Iterable, Sequence

import numpy as np

from cbatch.ipc.records import (
    ALL_FLAGS,
    FLAG_LAST,
    MAX_FINISH_CODE,
    MAX_TEXT_BYTES,
    NO_TOKEN,
    RECORD_DTYPE,
    RECORD_SIZE_BYTES,
    RECORD_STRUCT,
    RingRecord,
    TokenEvent,
    frame_events,
)

MAGIC = int.from_bytes(b"CBRING01", "little")
LAYOUT_VERSION = 4  # 4: the generation decode's roster in a 4096-byte header
HEADER_SIZE_BYTES = 4096
MAX_CAPACITY_RECORDS = 1 << 24  # 1 GiB of records; anything bigger is a corrupt header
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory segments

# Positions of the mutable uint64 header fields (0..3: magic, version, capacity, record_size).
_H_WRITE_CURSOR, _H_HEARTBEAT_NS = 4, 5
_H_FIRST_MARK = 6
_H_ROSTER = 16
_NUM_HEADER_FIELDS = HEADER_SIZE_BYTES // 8
MAX_ROSTER_IDS = _NUM_HEADER_FIELDS - _H_ROSTER  # a larger decode's ids are not kept: all are suspects

_SEQ_BYTES = 8  # the writer stores the body (bytes 8..64) and the seq marker separately
_VALID_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


# Machine names (platform.machine(): uname on Linux, the registry's on Windows) of the
# CPUs whose memory ordering the ring's stores and loads rely on.
TSO_MACHINES = frozenset({"x86_64", "AMD64"})


def is_ring_ordered() -> bool:
    """Whether this host's CPU orders memory as the ring's lock-free protocol needs."""
    return platform.machine() in TSO_MACHINES


class CrashMark(enum.IntEnum):
    """The header's crash marks, which the supervisor reads when the worker dies, to tell who
    crashed it (workers/daemon/crash_blame.py). Each belongs to one thread of the worker, so no
    thread overwrites another's: the request the decode loop samples for alone, the one each
    preparer prepares (request ids, 0 = none), and how many requests the llama_decode that runs
    on the generation context or the embeddings' computes for (0 = none runs); the generation
    decode's request ids are in the roster."""

    SAMPLING = 0
    PREPARING = 1
    PREPARING_LARGE = 2
    DECODING = 3
    EMBEDDING = 4
    COMPILING = 5  # the preparer of requests whose constraint is compiled


_DECODING_MARKS = (CrashMark.DECODING, CrashMark.EMBEDDING)
# A request mark's value while its thread is in native code for several requests at once
# (the sampling's joint mask fill): a crash there names no one request.
SEVERAL_REQUESTS = (1 << 64) - 1


@dataclass(frozen=True)
class CrashMarks:
    request_ids: tuple[int, ...]  # the requests the worker was inside native code for alone
    is_decoding: bool  # inside llama_decode, which computes for many requests at once
    # The requests of the generation llama_decode that ran; None: more than the roster holds.
    decoding_ids: tuple[int, ...] | None = ()
    is_several: bool = False  # a thread was in native code for several requests it did not name


class RingError(Exception):
    """Invalid segment, header or record, or a ring that cannot be created/attached."""


class RingOverrun(RingError):
    """The reader was lapped or saw an index gap; see the module docstring for recovery."""

    def __init__(self, request_ids: Iterable[int], records: list[RingRecord]):
        self.request_ids = frozenset(request_ids)
        self.records = records
        super().__init__(f"ring overrun: records of requests {sorted(self.request_ids)} "
                         "may be missing; recover them and call resume()")


class TokenRing:
    """A mapped ring segment. Use create_ring() / attach_ring() to get one."""

    def __init__(self, name: str, buf, owner, shm: shared_memory.SharedMemory | None):
        self._name, self._owner, self._shm = name, owner, shm  # shm only in the creator
        # The creator's segment as a file, (st_dev, st_ino): whether /dev/shm/<name> is still it.
        self._file_id = _file_id(name) if shm is not None else None
        self.capacity = _validated_capacity(name, buf)
        self.header = np.ndarray((_NUM_HEADER_FIELDS,), "<u8", buffer=buf)
        self.records = np.ndarray((self.capacity,), RECORD_DTYPE, buffer=buf,
                                  offset=HEADER_SIZE_BYTES)
        self.raw = np.ndarray((self.capacity, RECORD_SIZE_BYTES), np.uint8, buffer=buf,
                              offset=HEADER_SIZE_BYTES)
        # Strided view of just the seq markers: aligned 8-byte loads/stores.
        self.seqs = np.ndarray((self.capacity,), "<u8", buffer=buf, offset=HEADER_SIZE_BYTES,
                               strides=(RECORD_SIZE_BYTES,))

    name = property(lambda self: self._name)
    write_cursor = property(lambda self: int(self.header[_H_WRITE_CURSOR]))
    heartbeat_ns = property(lambda self: int(self.header[_H_HEARTBEAT_NS]))

    def marker(self, mark: CrashMark) -> Callable[[int], None]:
        """What the one thread that owns `mark` calls with its value before it enters native
        code, and with 0 after; a no-op once closed."""
        def set_mark(value: int) -> None:
            if self.header is not None:
                self.header[_H_FIRST_MARK + mark] = value
        return set_mark

    def decode_marker(self, mark: CrashMark) -> Callable[[Sequence[int]], None]:
        """What the one thread that owns a decoding mark calls with the request ids of the
        llama_decode it enters, and with () after: the mark holds their number, the roster
        the generation decode's ids (the embeddings' are ids of another kind)."""
        def set_decoding(request_ids: Sequence[int]) -> None:
            if self.header is None:
                return
            num_ids = len(request_ids)
            if mark is CrashMark.DECODING and num_ids <= MAX_ROSTER_IDS:
                self.header[_H_ROSTER:_H_ROSTER + num_ids] = request_ids
            self.header[_H_FIRST_MARK + mark] = num_ids
        return set_decoding

    def take_crash_marks(self) -> CrashMarks:
        """The marks a dead worker left, cleared for the next worker."""
        marks = self.header[_H_FIRST_MARK:_H_FIRST_MARK + len(CrashMark)].tolist()
        self.header[_H_FIRST_MARK:_H_FIRST_MARK + len(CrashMark)] = 0
        num_decoding = marks[CrashMark.DECODING]
        decoding_ids = (tuple(self.header[_H_ROSTER:_H_ROSTER + num_decoding].tolist())
                        if num_decoding <= MAX_ROSTER_IDS else None)
        request_marks = [marks[mark] for mark in CrashMark if mark not in _DECODING_MARKS and marks[mark]]
        return CrashMarks(tuple(value for value in request_marks if value != SEVERAL_REQUESTS),
                          any(marks[mark] for mark in _DECODING_MARKS), decoding_ids, SEVERAL_REQUESTS in request_marks)

    def close(self) -> None:
        if self._owner is None:
            return
        # The numpy views export the buffer; mmap refuses to close while any exists.
        self.header = self.records = self.raw = self.seqs = None
        owner, self._owner = self._owner, None
        try:
            owner.close()
        except BufferError as exc:
            raise RingError(f"ring {self._name!r} still has live views: {exc}") from exc

    def is_linked(self) -> bool:
        """Whether /dev/shm/<name> is still this segment (creator only): a cleaner of
        /dev/shm or a remounted tmpfs removes it under its readers and writer, whose
        mappings live on, while a new process can no longer attach it."""
        return self._file_id is not None and _file_id(self._name) == self._file_id

    def unlink(self) -> None:
        """Remove the segment (creator only). Existing mappings stay valid until closed."""
        if self._shm is None:
            raise RingError("only the process that created the ring may unlink it")
        if self.is_linked():
            self._shm.unlink()  # also drops the creator's resource-tracker registration
        else:  # someone else removed it (or put another file there): only forget the registration
            resource_tracker.unregister("/" + self._name, "shared_memory")

    def __enter__(self) -> TokenRing:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _validated_capacity(name: str, buf) -> int:
    # struct instead of a numpy view: a view left alive by the exception's traceback
    # would keep the mapping from being closed.
    if len(buf) < HEADER_SIZE_BYTES:
        raise RingError(f"segment {name!r} is {len(buf)} bytes, smaller than a header")
    magic, version, capacity, record_size = struct.unpack_from("<4Q", buf)
    if magic != MAGIC:
        raise RingError(f"segment {name!r} is not a token ring (magic {magic:#x})")
    if version != LAYOUT_VERSION:
        raise RingError(f"ring {name!r} has layout version {version}, need {LAYOUT_VERSION}")
    if record_size != RECORD_SIZE_BYTES:
        raise RingError(f"ring {name!r} has record size {record_size}")
    if not 0 < capacity <= MAX_CAPACITY_RECORDS or capacity & (capacity - 1):
        raise RingError(f"ring {name!r} has invalid capacity {capacity}")
    if len(buf) < HEADER_SIZE_BYTES + capacity * RECORD_SIZE_BYTES:
        raise RingError(f"segment {name!r} is too small for {capacity} records")
    return capacity


def _file_id(name: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(os.path.join(SHM_DIR, name))
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _VALID_NAME.fullmatch(name):
        raise RingError(f"invalid segment name {name!r}")
    return name


def create_ring(name: str | None, capacity: int) -> TokenRing:
    """Create a zeroed segment (mode 0600, SharedMemory's default) and write its header.
    name None picks a random free name (see .name)."""
    if not isinstance(capacity, int) or not 0 < capacity <= MAX_CAPACITY_RECORDS \
            or capacity & (capacity - 1):
        raise RingError(f"capacity must be a power of two <= {MAX_CAPACITY_RECORDS}")
    size_bytes = HEADER_SIZE_BYTES + capacity * RECORD_SIZE_BYTES
    try:
        shm = shared_memory.SharedMemory(None if name is None else _check_name(name),
                                         create=True, size=size_bytes)
    except OSError as exc:
        raise RingError(f"cannot create ring {name!r}: {exc}") from exc
    struct.pack_into("<4Q", shm.buf, 0, MAGIC, LAYOUT_VERSION, capacity, RECORD_SIZE_BYTES)
    return TokenRing(shm.name, shm.buf, shm, shm)


def attach_ring(name: str) -> TokenRing:
    """Map an existing ring and validate its header. Registers nothing with the resource
    tracker (see the module docstring), so this process's exit never unlinks the ring."""
    path = os.path.join(SHM_DIR, _check_name(name))
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise RingError(f"cannot open ring {name!r}: {exc}") from exc
    try:
        size_bytes = os.fstat(fd).st_size
        if size_bytes < HEADER_SIZE_BYTES:
            raise RingError(f"segment {name!r} is {size_bytes} bytes, smaller than a header")
        mapping = mmap.mmap(fd, size_bytes)
    except OSError as exc:
        raise RingError(f"cannot map ring {name!r}: {exc}") from exc
    finally:
        os.close(fd)
    try:
        return TokenRing(name, mapping, mapping, None)
    except RingError:
        mapping.close()
        raise


class RingWriter:
    """The single writer (decode worker). Continues at the header's write_cursor, so a
    restarted worker appends after its predecessor's records. Never waits for readers."""

    def __init__(self, ring: TokenRing):
        self._ring = ring
        self._cursor = ring.write_cursor

    def publish_many(self, events: list[TokenEvent]) -> list[int]:
        """Append the records of several events and advance write_cursor once. Returns each
        event's next index."""
        return self.publish_step(events)[0]

    def publish_step(self, events: list[TokenEvent]) -> tuple[list[int], np.ndarray]:
        """publish_many, also returning the step's records as stored (RECORD_DTYPE, seq left
        0). The step's records are framed as one array (frame_events) before anything is
        stored, so an invalid event publishes nothing (RingError)."""
        try:
            framed, counts = frame_events(events)
            next_indices = [event.index + count for event, count in zip(events, counts)]
        except (KeyError, struct.error, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise RingError(f"invalid event: {exc!r}") from exc
        if len(framed):
            self._store(framed.view(np.uint8).reshape(len(framed), RECORD_SIZE_BYTES))  # one write for the step
        else:
            self.heartbeat()
        return next_indices, framed

    def _store(self, data: np.ndarray) -> None:
        """data: (records, RECORD_SIZE_BYTES) uint8, the framed records."""
        ring = self._ring
        capacity = ring.capacity
        num_records = len(data)
        first_position = self._cursor
        if num_records > capacity:  # the batch laps itself: only its tail survives
            data = data[num_records - capacity:]
            first_position += num_records - capacity
        num_stored = len(data)
        first_slot = first_position & (capacity - 1)
        num_before_wrap = min(num_stored, capacity - first_slot)
        # (slot range, data range) spans: at most two, split where the ring wraps.
        spans = [(first_slot, first_slot + num_before_wrap, 0, num_before_wrap)]
        if num_before_wrap < num_stored:
            spans.append((0, num_stored - num_before_wrap, num_before_wrap, num_stored))
        seqs, raw = ring.seqs, ring.raw
        for slot_a, slot_b, _, _ in spans:  # 1. mark slots "being written"
            seqs[slot_a:slot_b] = 0
        for slot_a, slot_b, data_a, data_b in spans:  # 2. bodies
            raw[slot_a:slot_b, _SEQ_BYTES:] = data[data_a:data_b, _SEQ_BYTES:]
        new_seqs = np.arange(first_position + 1, first_position + num_stored + 1, dtype=np.uint64)
        for slot_a, slot_b, data_a, data_b in spans:  # 3. commit markers
            seqs[slot_a:slot_b] = new_seqs[data_a:data_b]
        self._cursor += num_records
        # Stamped before the cursor moves: a reader that sees the batch sees its publish time.
        self.heartbeat()
        ring.header[_H_WRITE_CURSOR] = self._cursor  # 4. publish the batch

    def heartbeat(self) -> None:
        self._ring.header[_H_HEARTBEAT_NS] = time.monotonic_ns()


class RingReader:
    """Returns the records of watched request ids exactly once, in index order. Watch a
    request before its first record is published (or pass the index to start from). Records
    held back after a gap stay in memory until resume() or unwatch()."""

    def __init__(self, ring: TokenRing, start_cursor: int | None = None):
        self._ring = ring
        self._cursor = ring.write_cursor if start_cursor is None else start_cursor
        self._next_index: dict[int, int] = {}  # watched request id -> next expected index
        self._held: dict[int, list[RingRecord]] = {}  # ids awaiting resume() after a gap
        self._finished: set[int] = set()  # watched ids whose LAST record was delivered
        self._released: list[RingRecord] = []  # freed by resume(), returned by the next poll
        self._regapped: set[int] = set()  # ids that resume() could not close the gap of

    cursor = property(lambda self: self._cursor)

    def watch(self, request_id: int, next_index: int = 0) -> None:
        """Deliver this request's records from index next_index on (resets its state)."""
        self.unwatch(request_id)
        self._next_index[request_id] = next_index

    def unwatch(self, request_id: int) -> None:
        self._next_index.pop(request_id, None)
        self._held.pop(request_id, None)
        self._finished.discard(request_id)
        self._regapped.discard(request_id)

    def rewind(self, num_records: int) -> None:
        """Read again from up to num_records back (never before the ring's first record):
        a watched request's records below its next index are dropped as duplicates."""
        self._cursor = max(self._cursor - num_records, 0)

    def next_index(self, request_id: int) -> int:
        return self._next_index[request_id]

    def resume(self, request_id: int, next_index: int) -> None:
        """The caller recovered this request's records up to next_index - 1 elsewhere."""
        if request_id not in self._next_index:
            raise RingError(f"request {request_id} is not watched")
        held = self._held.pop(request_id, [])
        self._next_index[request_id] = max(next_index, self._next_index[request_id])
        for record in held:
            self._accept(record, self._released, self._regapped)

    def _accept(self, record: RingRecord, out: list[RingRecord], gapped: set[int]) -> None:
        request_id = record.request_id
        held = self._held.get(request_id)
        if held is not None:
            held.append(record)
            return
        expected = self._next_index[request_id]
        if record.index < expected:  # duplicate of a record delivered or recovered before
            return
        if record.index > expected:
            self._held[request_id] = [record]
            gapped.add(request_id)
            return
        self._next_index[request_id] = expected + 1
        if record.flags & FLAG_LAST:
            self._finished.add(request_id)
        out.append(record)

    def _lose_all(self, gapped: set[int]) -> None:
        for request_id in self._next_index.keys() - self._finished - self._held.keys():
            self._held[request_id] = []
            gapped.add(request_id)

    def poll(self) -> list[RingRecord]:
        """Newly published records of watched requests, in order. Raises RingOverrun (see
        the module docstring) when records may have been lost, RingError on corrupt data."""
        write_cursor = int(self._ring.header[_H_WRITE_CURSOR])
        if write_cursor == self._cursor and not self._released and not self._regapped:
            return []  # the common idle case: one header load
        new_records, new_cursor, is_lapped = self._read(write_cursor)  # no state change yet
        out, self._released = self._released, []
        gapped, self._regapped = self._regapped, set()
        for record in new_records:
            self._accept(record, out, gapped)
        if is_lapped:
            self._lose_all(gapped)
        self._cursor = new_cursor
        if gapped:
            raise RingOverrun(gapped, out)
        return out

    def _read(self, write_cursor: int) -> tuple[list[RingRecord], int, bool]:
        """Copy and validate [cursor, write_cursor): (watched records, new cursor, is_lapped)."""
        ring, cursor = self._ring, self._cursor
        num_new = write_cursor - cursor
        if num_new < 0:
            raise RingError(f"write cursor went back from {cursor} to {write_cursor}")
        if num_new > ring.capacity:
            return [], write_cursor, True
        if num_new == 0:
            return [], cursor, False
        first_slot = cursor & (ring.capacity - 1)
        end_slot = first_slot + num_new
        if end_slot <= ring.capacity:
            copied = ring.records[first_slot:end_slot].copy()
            reloaded_seqs = ring.seqs[first_slot:end_slot].copy()  # loaded after the copy
        else:
            end_slot -= ring.capacity
            copied = np.concatenate((ring.records[first_slot:], ring.records[:end_slot]))
            reloaded_seqs = np.concatenate((ring.seqs[first_slot:], ring.seqs[:end_slot]))
        expected_seqs = np.arange(cursor + 1, write_cursor + 1, dtype=np.uint64)
        is_intact = (copied["seq"] == expected_seqs) & (reloaded_seqs == expected_seqs)
        num_intact = num_new if is_intact.all() else int(np.argmin(is_intact))
        watched = self._next_index
        records = []
        for (_, request_id, index, token_id, flags, finish, text_len, count,
             text) in RECORD_STRUCT.iter_unpack(copied[:num_intact].tobytes()):
            if request_id not in watched:
                continue
            if (text_len > MAX_TEXT_BYTES or flags & ~ALL_FLAGS or finish > MAX_FINISH_CODE
                    or token_id < NO_TOKEN or bool(finish) != bool(flags & FLAG_LAST)
                    or (finish and count != index + 1)):
                raise RingError(f"corrupt record for request {request_id} index {index}")
            records.append(RingRecord(request_id, index, token_id, flags, finish, count,
                                      text[:text_len]))
        if num_intact < num_new:  # a writer lapped us during the copy: skip to the present
            return records, int(ring.header[_H_WRITE_CURSOR]), True
        return records, write_cursor, False
