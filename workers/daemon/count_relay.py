"""The front-end's token counts (COUNT): a request's prompt rendered and tokenized by the
decode worker's preparer, as the model would see it, and nothing run (Anthropic's
`/v1/messages/count_tokens`). A question with a nonce, as EMBED is: one reply, COUNT_REPLY
or ERROR. Asked while no worker is ready, it is refused (`unavailable`) rather than held;
one in a worker that dies fails with `worker_restarted`."""

from cbatch.errors import INVALID_REQUEST, SHUTTING_DOWN, UNAVAILABLE, CbatchError
from cbatch.params import parse_request
from cbatch.protocol import MsgType, field
from cbatch.workers.daemon.client_link import ClientLink
from cbatch.workers.daemon.worker_link import WorkerLink
from cbatch.workers.messages import WorkerCount, WorkerCounted


class CountRelay:
    def __init__(self, clients: ClientLink, worker: WorkerLink, max_pending: int):
        self._clients, self._worker, self._max_pending = clients, worker, max_pending
        self._askers: dict[int, tuple[bytes, int]] = {}  # count id -> (client identity, its nonce)
        self._next_id = 0

    @property
    def num_pending(self) -> int:
        return len(self._askers)

    def on_count(self, identity: bytes, body: dict, is_draining: bool) -> None:
        """Raises ProtocolError or CbatchError (the front-end replies with the nonce)."""
        nonce = field(body, "nonce", int)
        request = parse_request(self._next_id + 1, field(body, "body", dict))
        if is_draining:
            raise CbatchError(SHUTTING_DOWN, "the daemon is shutting down and accepts no new requests")
        if self._worker.ready is None:
            raise CbatchError(UNAVAILABLE, "the decode worker is starting; count again in a moment")
        if len(self._askers) >= self._max_pending:
            raise CbatchError(INVALID_REQUEST, f"{self._max_pending} token counts are waiting; count fewer at once")
        self._next_id += 1
        self._askers[self._next_id] = (identity, nonce)
        self._worker.send(WorkerCount(self._next_id, request))

    def on_counted(self, message: WorkerCounted) -> None:
        asker = self._askers.pop(message.count_id, None)
        if asker is None:
            return
        identity, nonce = asker
        if message.code:
            self._clients.send(identity, MsgType.ERROR, {"code": message.code, "message": message.message,
                                                         "nonce": nonce})
        else:
            self._clients.send(identity, MsgType.COUNT_REPLY, {"nonce": nonce, "num_tokens": message.num_tokens})

    def fail_all(self, code: str, message: str) -> None:
        """The worker is gone with the counts it held."""
        for count_id in list(self._askers):
            self.on_counted(WorkerCounted(count_id, code=code, message=message))
