"""The daemon's socket to the decode worker, and what is known of the live worker.

The supervisor owns it: it names each worker it starts (expect), waits for its READY or
its failure, and stops it. The front-end sends requests over it and relays its events.

Each worker speaks under a routing id of its generation (cbatch.workers.decode.plan.worker_identity),
so the last messages of a worker that died are told apart from the live one's and dropped:
its requests were failed already.
"""

import zmq

from cbatch.workers.decode.plan import worker_identity
from cbatch.workers.messages import WorkerFailed, WorkerReady, decode, encode


class WorkerLink:
    def __init__(self, zctx: zmq.Context, control_endpoint: str):
        self.socket = zctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # Never drop a submit or cancel on its way to the worker: no high-water mark here
        # (the in-flight count is bounded by --parallel + each priority's queue instead).
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.bind(control_endpoint)
        self._identity: bytes | None = None  # the worker started last
        self.ready: WorkerReady | None = None  # None while (re)starting
        self.failure: WorkerFailed | None = None  # why the last worker could not start
        self.stats: dict = {}  # the live worker's latest engine snapshot

    def expect(self, generation: int) -> None:
        """A new worker of this generation is starting: until its READY, nothing is sent."""
        self._identity = worker_identity(generation)
        self.ready = self.failure = None

    def send(self, message) -> None:
        self.send_encoded(encode(message))

    def send_encoded(self, frames: list[bytes]) -> None:
        if self.ready is not None:
            self.socket.send_multipart([self._identity, *frames], zmq.NOBLOCK)

    def receive(self):
        """Yield the live worker's messages; READY, FAILED and stats are recorded on the way."""
        while self.socket.poll(0):
            identity, *frames = self.socket.recv_multipart()
            if identity != self._identity:
                continue  # a dead worker's
            message = decode(frames)
            if isinstance(message, WorkerReady):
                self.ready = message
            elif isinstance(message, WorkerFailed):
                self.failure = message
            elif getattr(message, "stats", None) is not None:
                self.stats = message.stats
            yield message

    def close(self) -> None:
        self.socket.close()
