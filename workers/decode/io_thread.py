"""The decode worker's I/O thread: the only thread that touches the front-end's socket.

It puts the submits the front-end sends into `inbox` (for the preparer) and every other
command into `commands` (for the loop thread, so a cancel never waits behind a long
preparation), and sends what the loop thread hands it through an inproc pipe, so the
decode loop never blocks on a socket. A command it cannot read is answered with a
rejection of the request it names, so that request never waits forever. It also watches the
supervisor: a worker whose supervisor died stops itself.
"""

import multiprocessing
import os
import queue
import threading
import traceback
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from cbatch.errors import INTERNAL
from cbatch.params import Request
from cbatch.protocol import MsgType, ProtocolError, split_frames
from cbatch.workers.decode.plan import WorkerPlan, worker_identity
from cbatch.workers.decode.preparer import is_large_prompt
from cbatch.workers.messages import (
    WorkerCount,
    WorkerEmbed,
    WorkerReject,
    WorkerStop,
    WorkerSubmit,
    decode,
    encode,
)

IO_POLL_MS = 500
# Commands whose first field is the request they are about (workers/messages.py).
REQUEST_COMMANDS = (MsgType.WORKER_SUBMIT, MsgType.WORKER_CANCEL, MsgType.WORKER_PAUSE)
ORPHAN_EXIT_S = 1.5  # a worker whose supervisor died is gone this long after noticing, whatever it was doing


class WorkerIO(threading.Thread):
    """Receives submits into `inbox` and other commands into `commands`; forwards what
    the loop thread `send`s."""

    def __init__(self, zctx: zmq.Context, plan: WorkerPlan):
        super().__init__(name="worker-io", daemon=True)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # submits, for the preparer
        self.large_inbox: queue.SimpleQueue = queue.SimpleQueue()  # submits of large prompts, for their preparer
        self.compile_inbox: queue.SimpleQueue = queue.SimpleQueue()  # submits whose constraint is compiled
        # Whether a request's constraint would be compiled (the engine's, set once it is made).
        self.needs_compile: Callable[[Request], bool] = lambda request: False
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # prepared sequences and other commands, for the loop
        self.preparing: set[int] = set()  # request ids submitted, not yet through the preparer
        self.preparing_embeds: set[int] = set()  # the same of embedding requests
        self._zctx, self._plan = zctx, plan
        self._pipe_address = f"inproc://worker-io-{id(self)}"
        self._pipe = zctx.socket(zmq.PAIR)  # loop-thread end
        self._pipe.setsockopt(zmq.SNDHWM, 0)  # a PAIR at its mark would block the decode loop
        self._pipe.bind(self._pipe_address)
        # For the front-end, in order; a DEALER with no peer would block a send. Touched by
        # this thread only.
        self._outgoing: deque[list[bytes]] = deque()
        self._is_orphaned = False

    def send(self, message) -> None:
        self._pipe.send_multipart(encode(message))

    def close(self) -> None:
        if self.is_alive():
            self._pipe.send_multipart([b""])  # the stop sentinel: not a protocol message
            self.join(timeout=5)
        self._pipe.close(linger=0)

    def run(self) -> None:
        control, pipe = self._open_sockets()
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        poller.register(pipe, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        if parent is not None:
            poller.register(parent.sentinel, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(IO_POLL_MS))
                if parent is not None and parent.sentinel in ready:
                    poller.unregister(parent.sentinel)
                    self._on_orphaned()
                if pipe in ready and not self._take_from_loop(pipe):
                    return
                if control in ready and ready[control] & zmq.POLLIN:
                    self._receive(control)
                self._flush(control)
                poller.modify(control, zmq.POLLIN | (zmq.POLLOUT if self._outgoing else 0))
        except BaseException:
            # Without this thread the worker can neither hear nor answer the front-end while
            # its heartbeat keeps the watchdog content: end it, and the supervisor restarts it.
            traceback.print_exc()
            os._exit(1)
        finally:
            pipe.close(linger=0)
            control.close()

    def _open_sockets(self) -> tuple[zmq.Socket, zmq.Socket]:
        """The DEALER to the front-end, and this thread's end of the loop thread's pipe."""
        control = self._zctx.socket(zmq.DEALER)
        control.setsockopt(zmq.LINGER, 1000)  # let the last events and the goodbye reach the front-end
        control.setsockopt(zmq.SNDHWM, 0)  # events are never dropped on the way to the front-end
        control.setsockopt(zmq.RCVHWM, 0)
        control.setsockopt(zmq.IDENTITY, worker_identity(self._plan.generation))
        control.connect(self._plan.control_endpoint)
        pipe = self._zctx.socket(zmq.PAIR)
        pipe.setsockopt(zmq.RCVHWM, 0)
        pipe.connect(self._pipe_address)
        return control, pipe

    def _on_orphaned(self) -> None:
        """The supervisor died (SIGKILL, OOM): nobody will read or stop us. Ask the loop to
        stop, keep taking its sends (a send to a closed pipe would block it forever), and
        end the process if it is slow to go (a long llama_decode, a tokenizer busy with a
        large prompt)."""
        self._is_orphaned = True
        self._outgoing.clear()
        self.commands.put(WorkerStop())
        deadline = threading.Timer(ORPHAN_EXIT_S, os._exit, (1,))
        deadline.daemon = True  # a clean exit must not wait for it
        deadline.start()

    def _take_from_loop(self, pipe: zmq.Socket) -> bool:
        """Queue what the loop thread sent for the front-end; False at its stop sentinel."""
        frames = pipe.recv_multipart()
        if frames == [b""]:
            return False
        if not self._is_orphaned:
            self._outgoing.append(frames)
        return True

    def _receive(self, control: zmq.Socket) -> None:
        frames = control.recv_multipart()
        try:
            message = decode(frames)
        except (ProtocolError, TypeError) as err:
            # Only the front-end talks to this socket, so this is a bug; the request it
            # names must still end.
            request_id = _named_request_id(frames)
            if request_id is not None and not self._is_orphaned:
                self._outgoing.append(encode(WorkerReject(request_id, INTERNAL, f"the worker could not read a command "
                                                                                f"for this request: {err}")))
            return
        if isinstance(message, WorkerSubmit):
            self.preparing.add(message.request_id)  # before the preparer can hand it on
            inbox = (self.large_inbox if is_large_prompt(message) else
                     self.compile_inbox if self.needs_compile(message.request) else self.inbox)
            inbox.put(message)
        elif isinstance(message, WorkerEmbed):  # tokenized by the preparer too
            self.preparing_embeds.add(message.embed_id)
            self.inbox.put(message)
        elif isinstance(message, WorkerCount):  # rendered and tokenized there, nothing more
            self.inbox.put(message)
        else:
            self.commands.put(message)

    def _flush(self, control: zmq.Socket) -> None:
        while self._outgoing:
            try:
                control.send_multipart(self._outgoing[0], zmq.NOBLOCK)
            except zmq.Again:  # no front-end connected (yet, or any more)
                return
            self._outgoing.popleft()


def _named_request_id(frames: list[bytes]) -> int | None:
    """The request a command that could not be read names: the first field of those whose
    first field is a request id (a submit's request's first field), if it is one."""
    try:
        msg_type, body = split_frames(frames)
        fields = msgspec.msgpack.decode(body)
    except (ProtocolError, msgspec.DecodeError):
        return None
    if msg_type not in REQUEST_COMMANDS or not isinstance(fields, list) or not fields:
        return None
    request_id = fields[0]
    if msg_type is MsgType.WORKER_SUBMIT and isinstance(request_id, list) and request_id:
        request_id = request_id[0]  # the Request's own array, its id first
    return request_id if isinstance(request_id, int) and not isinstance(request_id, bool) else None
