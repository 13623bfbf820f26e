"""One ring reader per client process, shared by every session that reads the same ring.

A session used to scan the ring itself on every tick, so 64 Clients in one process (a
threaded web app) woke 64 times a step, parsed every record 64 times and took turns on
the GIL. Now one reader per ring per process does the reading: a thread wakes on the
worker's tick, reads each published step once and puts each watched request's records
into the inbox of the session that watches it, waking only the sessions that got
something their reader waits for (the records of a muted request, one generate() waits
on whole, wake nobody: ring_inbox.py). A session drains its inbox on its own thread, so
session state is only ever touched by the thread that owns it.

Exactly once: the one RingReader, under a lock, returns each record once, and each
record goes to the one inbox that watches its request.

Finalizers: a client dropped without close() (an AsyncClient in a reference cycle, say)
gives its tap back when the garbage collector runs, and the collector runs on whatever
thread happens to allocate, the reader's own included, in the middle of pump() with the
lock held. So the collected path never takes the reader's lock and waits for nothing: it
queues the departure, and the reader thread applies it (unwatch, close the inbox, release)
at its next wake-up, which the queueing causes. Only an explicit close() gives back at
once. A collection can also come after the reader thread ended (seen in a benchmark: a
client from an earlier daemon's phase collected on a thread of the next): the wake pipe is
closed then, and a write to its number could land in whatever reused it, so the pipe is
written and closed under a lock of its own (held for the write or the close, nothing
else), and a departure that finds it closed closes its inbox itself.

Overruns: the ids the RingReader reports as gapped reach their inbox as gap notices; the session fetches what it missed
over ZeroMQ and calls resume(). Any thread may also pump the reader itself (`pump()`),
as a session does before it acts on a FINISHED message, whose records the worker wrote
before the message was sent.
"""

import os
import threading
import weakref
from collections import deque
from collections.abc import Iterable

import zmq

from cbatch.client.ring_inbox import RingInbox
from cbatch.ipc.ring import RingError, RingOverrun, RingReader, attach_ring

TICK_POLL_MS = 100  # read at least this often while requests are watched: a tick can be dropped
IDLE_POLL_MS = 1000  # and this often while none are (a watch does not wake the thread)


def _make_tick_socket(zctx, endpoint: str):
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 16)  # ticks carry no data: a few queued are as good as many
    sub.connect(endpoint)
    return sub


class SharedRingReader:
    """The process's reader of one ring; get it with acquire(), give it back with release()."""

    _instances: dict[tuple[int, str], "SharedRingReader"] = {}  # (pid, ring name) -> reader
    _instances_lock = threading.Lock()

    @classmethod
    def acquire(cls, ring_name: str, tick_endpoint: str) -> "SharedRingReader":
        """Raises RingError when the ring cannot be attached (another host, no access)."""
        key = (os.getpid(), ring_name)  # a forked child starts its own: the parent's thread is not there
        with cls._instances_lock:
            reader = cls._instances.get(key)
            if reader is None:
                reader = cls._instances[key] = cls(ring_name, tick_endpoint)
            reader._num_users += 1
            return reader

    def release(self) -> None:
        """An explicit give-back; the last one stops the reader thread and waits for it."""
        if self._drop_user():
            self._wake()
            self._thread.join()

    def _drop_user(self) -> bool:
        """One user fewer; True when it was the last: the reader thread is to stop."""
        with self._instances_lock:
            self._num_users -= 1
            if self._num_users:
                return False
            del self._instances[(os.getpid(), self._ring.name)]
            self._is_stopping = True
            return True

    def __init__(self, ring_name: str, tick_endpoint: str):
        self._ring = attach_ring(ring_name)
        self._reader = RingReader(self._ring)
        self._lock = threading.Lock()  # over _reader and _inbox_of; never taken by a finalizer
        self._inbox_of: dict[int, RingInbox] = {}  # watched request id -> the inbox of its session
        self._num_users = 0
        # Collected taps' (inbox, watched ids), for the reader thread: deque appends and
        # pops are atomic, so the finalizer that queues one takes no lock but the wake pipe's.
        self._departures: deque[tuple[RingInbox, list[int]]] = deque()
        self._is_stopping = False  # the last user left: the reader thread ends
        # Wakes the reader thread: a departure was queued, or the last user left. Written
        # and closed under _pipe_lock (reentrant: a finalizer may run on the thread that
        # holds it); once _is_pipe_closed, nothing writes to its descriptors again.
        self._wake_read_fd, self._wake_write_fd = os.pipe()
        os.set_blocking(self._wake_write_fd, False)
        self._pipe_lock = threading.RLock()
        self._is_pipe_closed = False
        self._thread = threading.Thread(target=self._run, args=(tick_endpoint,), name="cbatch-ring-reader",
                                        daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        with self._pipe_lock:
            if self._is_pipe_closed:
                return  # the thread ended: nothing to wake
            try:
                os.write(self._wake_write_fd, b"\0")
            except BlockingIOError:
                pass  # a full pipe wakes the thread as well

    def depart_later(self, inbox: RingInbox, request_ids: list[int]) -> None:
        """A collected tap's give-back, from whatever thread the collector ran on: queued
        for the reader thread, never blocking (see the module docstring)."""
        with self._pipe_lock:
            if self._is_pipe_closed:  # the thread ended: nothing puts into the inbox any more
                inbox.close()
                return
            self._departures.append((inbox, request_ids))
            self._wake()

    def _apply_departures(self) -> None:
        """On the reader thread, holding no lock: what collected taps queued."""
        while self._departures:
            inbox, request_ids = self._departures.popleft()
            with self._lock:
                for request_id in request_ids:
                    self._reader.unwatch(request_id)
                    self._inbox_of.pop(request_id, None)
            inbox.close()  # nothing puts into it any more: its ids are unwatched
            self._drop_user()

    @property
    def heartbeat_ns(self) -> int:
        return self._ring.heartbeat_ns

    def watch(self, request_id: int, inbox: RingInbox, next_index: int = 0) -> None:
        """Before the request is sent: its records may be published at once. next_index:
        the first record wanted (a request that came over from another ring)."""
        with self._lock:
            if not self._inbox_of:
                self._reader = RingReader(self._ring)  # idle until now: start at the ring's present
            self._reader.watch(request_id, next_index)
            self._inbox_of[request_id] = inbox

    def unwatch(self, request_id: int) -> None:
        with self._lock:
            self._reader.unwatch(request_id)
            self._inbox_of.pop(request_id, None)

    def rewind(self) -> None:
        """Read again from half a ring back: requests that come over from the front-end's
        relay have records in the ring from before they were watched here (the front-end
        stopped relaying them when the session said HELLO). What was read already is
        dropped by index; half a ring leaves the writer room to go on meanwhile."""
        with self._lock:
            self._reader.rewind(self._ring.capacity // 2)

    def resume(self, request_id: int, next_index: int) -> None:
        """The session recovered this request's records up to next_index - 1 over ZeroMQ."""
        with self._lock:
            if request_id in self._inbox_of:
                self._reader.resume(request_id, next_index)

    def pump(self) -> None:
        """Read what was published since the last read and hand it out."""
        with self._lock:
            gapped_ids = ()
            try:
                records = self._reader.poll()
            except RingOverrun as overrun:
                records, gapped_ids = overrun.records, overrun.request_ids
            except RingError as err:
                for inbox in set(self._inbox_of.values()):
                    inbox.put({}, error=err)
                return
            if not records and not gapped_ids:
                return
            rows_by_inbox: dict[RingInbox, dict[int, list]] = {}
            for r in records:
                rows = rows_by_inbox.setdefault(self._inbox_of[r.request_id], {}).setdefault(r.request_id, [])
                rows.append((r.index, r.token_id, r.flags, r.finish, r.count, r.text))
            gapped_by_inbox: dict[RingInbox, list[int]] = {}
            for request_id in gapped_ids:
                gapped_by_inbox.setdefault(self._inbox_of[request_id], []).append(request_id)
            for inbox in rows_by_inbox.keys() | gapped_by_inbox.keys():
                inbox.put(rows_by_inbox.get(inbox, {}), gapped_by_inbox.get(inbox, ()))

    def _run(self, tick_endpoint: str) -> None:
        tick = _make_tick_socket(zmq.Context.instance(), tick_endpoint)
        poller = zmq.Poller()
        poller.register(tick, zmq.POLLIN)
        poller.register(self._wake_read_fd, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(TICK_POLL_MS if self._inbox_of else IDLE_POLL_MS))
                if self._wake_read_fd in ready:
                    os.read(self._wake_read_fd, 4096)
                    self._apply_departures()
                    if self._is_stopping:
                        return
                while tick.poll(0):
                    tick.recv()
                self.pump()
        finally:  # the thread owns what it reads with, so nothing is closed under it
            tick.close(linger=0)
            with self._pipe_lock:
                self._is_pipe_closed = True
                os.close(self._wake_read_fd)
                os.close(self._wake_write_fd)
            while self._departures:  # queued after the last wake-up: no later one comes
                self._departures.popleft()[0].close()
            self._ring.close()


class RingTap:
    """One session's use of its process's shared reader: the session's inbox and the
    requests it watches. Used by the session's own thread only."""

    def __init__(self, ring_name: str, tick_endpoint: str, carried_streams: Iterable = ()):
        """carried_streams: the session's RequestStreams when it moves from another ring (a
        worker restart recreated it): those still running read on from their next index."""
        self._reader = SharedRingReader.acquire(ring_name, tick_endpoint)  # raises RingError
        self._inbox = RingInbox()
        self._watched_ids: set[int] = set()
        carried = [stream for stream in carried_streams if not stream.is_done and not stream.wants_logprobs]
        for stream in carried:
            self.watch(stream.request_id, stream.next_index, is_muted=not stream.keeps_chunks)
        if carried:
            self._reader.rewind()
        # A client dropped without close() still gives the reader back (and the last user's
        # going stops its thread) once it is collected, through the reader thread.
        self._finalizer = weakref.finalize(self, _give_back_later, self._reader, self._inbox, self._watched_ids)

    def close(self) -> None:
        """Give the reader back now (once; a collected tap gives it back by itself)."""
        if self._finalizer.detach() is not None:
            _give_back(self._reader, self._inbox, self._watched_ids)

    @property
    def wake_fd(self) -> int:
        return self._inbox.wake_fd

    @property
    def heartbeat_ns(self) -> int:
        return self._reader.heartbeat_ns

    def watch(self, request_id: int, next_index: int = 0, is_muted: bool = False) -> None:
        """is_muted: the request's records wake nobody (RingInbox)."""
        self._watched_ids.add(request_id)
        self._inbox.set_muted(request_id, is_muted)
        self._reader.watch(request_id, self._inbox, next_index)

    def unwatch(self, request_id: int) -> None:
        self._watched_ids.discard(request_id)
        self._reader.unwatch(request_id)
        self._inbox.set_muted(request_id, False)

    def recovered(self, request_id: int, next_index: int) -> None:
        """Records up to next_index - 1 came over ZeroMQ: the ring's later ones are due again."""
        self._reader.resume(request_id, next_index)
        self._reader.pump()

    def take(self, is_pumped: bool = False) -> tuple[dict[int, list], set[int], RingError | None]:
        """What the reader put for this session (see RingInbox.drain); with is_pumped, read
        the ring first, on this thread."""
        if is_pumped:
            self._reader.pump()
        return self._inbox.drain()


def _give_back(reader: SharedRingReader, inbox: RingInbox, watched_ids: set[int]) -> None:
    """RingTap.close(): the tap's requests, the reader and the inbox, given back now."""
    for request_id in watched_ids:  # the reader must not put into a closed inbox
        reader.unwatch(request_id)
    reader.release()
    inbox.close()


def _give_back_later(reader: SharedRingReader, inbox: RingInbox, watched_ids: set[int]) -> None:
    """The finalizer of a tap collected without close(): may run on any thread, the reader's
    own inside pump() included, so it only queues the give-back for the reader thread."""
    reader.depart_later(inbox, list(watched_ids))
