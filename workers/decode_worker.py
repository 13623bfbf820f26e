"""The decode worker process: the only process that loads the model.

Three threads, so that nothing but decoding runs on the loop's:
    WorkerIO (sockets) -> RequestPreparer (tokenize, chat template, grammar) -> engine loop
The main thread runs the engine loop and writes tokens into the shared-memory ring; a
slow or chatty front-end, a 1 MB prompt or a large grammar never stalls a decode step
(ctypes releases the GIL inside llama.cpp's tokenizer). Commands keep their order through
the preparer, so a cancel never overtakes its submit. After each step the loop publishes
the records, sends a tick on its PUB socket (waking local readers), and hands the step's
events to the front-end.
"""

import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

import llama_cpp  # noqa: F401  before zmq, see cbatch/__init__.py
import zmq

from cbatch.config import EngineConfig
from cbatch.errors import CbatchError, INTERNAL, INVALID_REQUEST
from cbatch.ipc.ring import RingWriter, attach_ring
from cbatch.params import parse_request
from cbatch.protocol import ProtocolError
from cbatch.workers.engine import Engine, SeqOutput, run_engine_loop
from cbatch.workers.messages import (TokenEvent, WorkerCancel, WorkerEvents, WorkerFailed, WorkerReady, WorkerReject,
                                      WorkerStop, WorkerSubmit, decode, encode)
from cbatch.workers.sequence import Sequence

IDLE_WAIT_S = 0.5  # an idle engine wakes this often to notice SIGTERM
IO_POLL_MS = 500
ORPHAN_EXIT_S = 1.5  # a worker whose supervisor died is gone this long after noticing, whatever it was doing
STATS_INTERVAL_S = 0.25  # at most this stale, the stats the front-end answers with


def worker_identity(generation: int) -> bytes:
    """The routing id a worker speaks to the front-end under: one per generation, so the
    front-end can tell a dead worker's last messages from the live one's."""
    return f"worker-{generation}".encode()


@dataclass(frozen=True)
class WorkerPlan:
    """What the supervisor hands to each worker it starts."""

    engine: EngineConfig
    control_endpoint: str  # the front-end's ROUTER for workers
    tick_endpoint: str  # this worker's PUB socket for ring wake-ups
    ring_name: str
    generation: int


class WorkerIO(threading.Thread):
    """Receives commands into `inbox`; forwards what the loop thread `send`s."""

    def __init__(self, zctx: zmq.Context, plan: WorkerPlan):
        super().__init__(name="worker-io", daemon=True)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._zctx, self._plan = zctx, plan
        self._pipe_address = f"inproc://worker-io-{id(self)}"
        self._pipe = zctx.socket(zmq.PAIR)  # loop-thread end
        self._pipe.setsockopt(zmq.SNDHWM, 0)  # a PAIR at its mark would block the decode loop
        self._pipe.bind(self._pipe_address)

    def send(self, message) -> None:
        self._pipe.send_multipart(encode(message))

    def close(self) -> None:
        if self.is_alive():
            self._pipe.send_multipart([b""])  # the stop sentinel: not a protocol message
            self.join(timeout=5)
        self._pipe.close(linger=0)

    def run(self) -> None:
        control = self._zctx.socket(zmq.DEALER)
        control.setsockopt(zmq.LINGER, 1000)  # let the last events and the goodbye reach the front-end
        control.setsockopt(zmq.SNDHWM, 0)  # events are never dropped on the way to the front-end
        control.setsockopt(zmq.RCVHWM, 0)
        control.setsockopt(zmq.IDENTITY, worker_identity(self._plan.generation))
        control.connect(self._plan.control_endpoint)
        pipe = self._zctx.socket(zmq.PAIR)
        pipe.setsockopt(zmq.RCVHWM, 0)
        pipe.connect(self._pipe_address)
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        poller.register(pipe, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        if parent is not None:
            poller.register(parent.sentinel, zmq.POLLIN)
        outgoing: deque[list[bytes]] = deque()  # for the front-end; a DEALER with no peer would block a send
        orphaned = False
        try:
            while True:
                ready = dict(poller.poll(IO_POLL_MS))
                if parent is not None and parent.sentinel in ready and not orphaned:
                    # The supervisor died (SIGKILL, OOM): nobody will read or stop us. Ask
                    # the loop to stop, keep taking its sends (a send to a closed pipe would
                    # block it forever), and end the process if it is slow to go (a long
                    # llama_decode, a tokenizer busy with a large prompt).
                    orphaned = True
                    poller.unregister(parent.sentinel)
                    outgoing.clear()
                    self.inbox.put(WorkerStop())
                    deadline = threading.Timer(ORPHAN_EXIT_S, os._exit, (1,))
                    deadline.daemon = True  # a clean exit must not wait for it
                    deadline.start()
                if pipe in ready:
                    frames = pipe.recv_multipart()
                    if frames == [b""]:
                        return
                    if not orphaned:
                        outgoing.append(frames)
                if control in ready and ready[control] & zmq.POLLIN:
                    try:
                        self.inbox.put(decode(control.recv_multipart()))
                    except (ProtocolError, TypeError):
                        pass  # only the front-end talks to this socket, and it sends valid messages
                while outgoing:
                    try:
                        control.send_multipart(outgoing[0], zmq.NOBLOCK)
                    except zmq.Again:  # no front-end connected (yet, or any more)
                        break
                    outgoing.popleft()
                poller.modify(control, zmq.POLLIN | (zmq.POLLOUT if outgoing else 0))
        except BaseException:
            # Without this thread the worker can neither hear nor answer the front-end while
            # its heartbeat keeps the watchdog content: end it, and the supervisor restarts it.
            traceback.print_exc()
            os._exit(1)
        finally:
            pipe.close(linger=0)
            control.close()


class RequestPreparer(threading.Thread):
    """Turns each SUBMIT from the I/O thread into a prepared Sequence (or a REJECT) and
    passes every other command through, all in arrival order."""

    def __init__(self, engine: Engine, source: queue.SimpleQueue):
        super().__init__(name="worker-prepare", daemon=True)
        self._engine, self._source = engine, source
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            message = self._source.get()
            self.outbox.put(self._prepare(message) if isinstance(message, WorkerSubmit) else message)

    def _prepare(self, submit: WorkerSubmit) -> Sequence | WorkerReject:
        try:
            return self._engine.prepare(parse_request(submit.request_id, submit.body))
        except (CbatchError, ValueError) as err:
            return _rejection(submit.request_id, err)
        except Exception as err:
            # A bug costs this request an `internal` error, not the worker: prepare reads only
            # the model, never engine state, so nothing the running requests rely on can be
            # broken, and ending the worker would fail all of them. The thread must live on:
            # without it every later submit would wait forever while the heartbeat (stamped by
            # the loop) kept the watchdog content.
            traceback.print_exc()
            return WorkerReject(submit.request_id, INTERNAL, f"the worker failed to prepare this request: "
                                                             f"{type(err).__name__}")


def _rejection(request_id: int, err: Exception) -> WorkerReject:
    if isinstance(err, CbatchError):
        return WorkerReject(request_id, err.code, err.message)
    return WorkerReject(request_id, INVALID_REQUEST, str(err))


class CommandHandler:
    """Applies prepared commands to the engine between steps."""

    def __init__(self, engine: Engine, io: WorkerIO, inbox: queue.SimpleQueue, stop: threading.Event,
                 publisher: "EventPublisher"):
        self._engine, self._io, self._inbox, self._stop, self._publisher = engine, io, inbox, stop, publisher

    def take(self, block: bool) -> bool:
        if block:
            self._publisher.send_stats()  # the engine just went idle: report zero active
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
            while True:
                self._apply(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return not self._stop.is_set()

    def _apply(self, item) -> None:
        """item: a prepared Sequence, or a message the preparer passed through."""
        if isinstance(item, Sequence):
            try:
                self._engine.add(item)
            except (CbatchError, ValueError) as err:
                self._io.send(_rejection(item.request_id, err))
        elif isinstance(item, WorkerReject):
            self._io.send(item)
        elif isinstance(item, WorkerCancel):
            self._engine.cancel(item.request_id)
        elif isinstance(item, WorkerStop):
            self._stop.set()


class EventPublisher:
    """Writes each step's outputs to the ring, ticks readers, and tells the front-end."""

    def __init__(self, engine: Engine, ring, io: WorkerIO, tick: zmq.Socket):
        self._engine, self._io, self._tick = engine, io, tick
        self._writer = RingWriter(ring)
        self._writer.heartbeat()  # before READY: the previous worker's stamp must not count
        self._next_index: dict[int, int] = {}
        self._stats_sent_at = 0.0

    def publish(self, outputs: list[SeqOutput]) -> None:
        if not outputs:  # a step of prompt chunks only: nothing to tell but liveness and stats
            if time.monotonic() - self._stats_sent_at >= STATS_INTERVAL_S:
                self.send_stats()
            else:
                self._writer.heartbeat()
            return
        events = [TokenEvent(out.request_id, self._next_index.get(out.request_id, 0), out.token_ids, out.text,
                             out.finish_reason or "", out.usage, out.error, out.logprobs) for out in outputs]
        for out, next_index in zip(outputs, self._writer.publish_many([event.ring_event() for event in events])):
            if out.finish_reason:
                self._next_index.pop(out.request_id, None)
            else:
                self._next_index[out.request_id] = next_index
        # Invariant: the records are in the ring before the tick and before the front-end
        # hears of them, so a reader told of a finish finds every record already there.
        self._tick.send(b"", zmq.NOBLOCK)
        is_stats_due = time.monotonic() - self._stats_sent_at >= STATS_INTERVAL_S
        self._io.send(WorkerEvents(events, self._stats() if is_stats_due else None))

    def send_stats(self) -> None:
        self._writer.heartbeat()  # idle is alive too: the supervisor's watchdog reads this
        self._io.send(WorkerEvents([], self._stats()))

    def _stats(self) -> dict:
        self._stats_sent_at = time.monotonic()
        return self._engine.snapshot()


def run_decode_worker(plan: WorkerPlan) -> None:
    stop = threading.Event()
    # Ctrl-C, and SIGTERM sent to the whole process group (systemd, kill -TERM -PGID), reach
    # this process too; the supervisor drains and then stops it with WORKER_STOP.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    zctx = zmq.Context()
    io = WorkerIO(zctx, plan)
    io.start()
    tick = zctx.socket(zmq.PUB)
    tick.setsockopt(zmq.LINGER, 0)
    engine = ring = None
    try:
        try:
            tick.bind(plan.tick_endpoint)
            ring = attach_ring(plan.ring_name)
            engine = Engine(plan.engine)
        except Exception as exc:
            io.send(WorkerFailed(str(exc), getattr(exc, "code", INTERNAL)))
            raise SystemExit(1)
        publisher = EventPublisher(engine, ring, io, tick)
        preparer = RequestPreparer(engine, io.inbox)
        preparer.start()
        io.send(WorkerReady(os.getpid(), engine.runner.description, engine.ctx_per_seq, engine.prefix_cache_note))
        handler = CommandHandler(engine, io, preparer.outbox, stop, publisher)
        run_engine_loop(engine, handler.take, publisher.publish)
    finally:
        io.close()
        tick.close()
        if ring is not None:
            ring.close()
        if engine is not None:
            engine.close()
        zctx.term()
