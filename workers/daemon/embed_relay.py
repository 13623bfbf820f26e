"""The front-end's embedding requests: checked, numbered, sent to the decode worker, answered.

An EMBED is a question with a nonce, as HEALTH is: one reply (EMBED_REPLY, or ERROR with
the nonce) carries all its vectors. Nothing streams, so nothing goes through the ring.
Requests that arrive while the worker (re)starts wait here and go to it when it is ready.

Each is its tenant's, as a generation is (tenant_ledger.py): in flight from here to its
reply, its tokens charged to the tenant's usage and bucket. A client call of more inputs
than one message carries comes as several messages, `part` 0, 1, ...: part 0 is held to
the tenant's limits and counts the request; the others only add their tokens, so that a
tenant with max_concurrent=1 can still embed a long list. The parts of one call are sent
together with consecutive nonces, so a later part whose part 0 was refused is known by its
nonce and refused the same way: none of a refused call runs.
"""

import time
from collections import OrderedDict

from cbatch.embeddings import MAX_INPUTS_PER_MESSAGE, parse_dimensions, parse_inputs
from cbatch.errors import QUEUE_FULL, SHUTTING_DOWN, CbatchError
from cbatch.params import parse_scheduling
from cbatch.protocol import MsgType, field
from cbatch.workers.daemon.client_link import ClientLink
from cbatch.workers.daemon.tenant_ledger import TenantLedger
from cbatch.workers.daemon.worker_link import WorkerLink
from cbatch.workers.messages import WorkerEmbed, WorkerEmbedCancel, WorkerEmbedded

# Clients whose last call was refused by its tenant's limits, remembered for its later
# parts; past this many the oldest is forgotten (its later parts would run, to no use).
MAX_REFUSED_CALLS = 1024


class EmbedRelay:
    def __init__(self, clients: ClientLink, worker: WorkerLink, max_pending: int, ledger: TenantLedger):
        self._clients, self._worker, self._max_pending, self._ledger = clients, worker, max_pending, ledger
        # embed id -> (client identity, its nonce, its tenant, whether it is part 0 of its call)
        self._owners: dict[int, tuple[bytes, int, str, bool]] = {}
        self._ids: dict[tuple[bytes, int], int] = {}  # (client identity, nonce) -> embed id, while it runs
        self._held: dict[int, WorkerEmbed] = {}  # not yet sent: no worker is ready
        # Cancelled in the worker: embed id -> (its tenant, part 0 or not), charged for the
        # tokens decoded when the worker's one reply to it comes.
        self._cancelled: dict[int, tuple[str, bool]] = {}
        self._refused: OrderedDict[bytes, tuple[int, CbatchError]] = OrderedDict()  # identity -> (part 0's nonce, why)
        self._next_id = 0

    @property
    def num_pending(self) -> int:
        return len(self._owners)

    def on_embed(self, identity: bytes, body: dict, is_draining: bool) -> None:
        """Raises ProtocolError or CbatchError (the front-end replies with the nonce)."""
        nonce = field(body, "nonce", int)
        inputs = parse_inputs(field(body, "input", (str, list)), MAX_INPUTS_PER_MESSAGE)
        dimensions = parse_dimensions(body.get("dimensions"))
        tenant = parse_scheduling({"tenant": body["tenant"]} if "tenant" in body else {}).tenant
        part = field(body, "part", int, optional=True) or 0
        is_first = part == 0
        if is_draining:
            raise CbatchError(SHUTTING_DOWN, "the daemon is shutting down and accepts no new requests")
        if len(self._owners) >= self._max_pending:
            raise CbatchError(QUEUE_FULL, f"{self._max_pending} embedding requests are waiting; retry later")
        refused = self._refused.get(identity)
        if not is_first and refused is not None and refused[0] == nonce - part:
            raise refused[1]
        try:
            self._ledger.admit(tenant, time.monotonic(), is_limited=is_first)  # RATE_LIMITED: nothing changes
        except CbatchError as err:
            self._refused[identity] = (nonce, err)
            self._refused.move_to_end(identity)
            if len(self._refused) > MAX_REFUSED_CALLS:
                self._refused.popitem(last=False)
            raise
        if is_first:
            self._refused.pop(identity, None)
        self._next_id += 1
        self._owners[self._next_id] = (identity, nonce, tenant, is_first)
        self._ids[identity, nonce] = self._next_id
        self._held[self._next_id] = WorkerEmbed(self._next_id, inputs, dimensions or 0)
        self.forward_held()

    def forward_held(self) -> None:
        if self._worker.ready is not None:
            for message in self._held.values():
                self._worker.send(message)
            self._held.clear()

    def on_cancel(self, identity: bytes, nonce: int) -> None:
        """Its caller has gone: the worker drops what it has not embedded yet, and the
        tenant's slot is free now; its usage and bucket are charged the tokens the worker
        decoded for it, when the worker says how many. Unknown: answered already."""
        embed_id = self._ids.pop((identity, nonce), None)
        if embed_id is None:
            return
        _, _, tenant, is_first = self._owners.pop(embed_id)
        self._ledger.release(tenant)
        if self._held.pop(embed_id, None) is None:
            self._cancelled[embed_id] = (tenant, is_first)
            self._worker.send(WorkerEmbedCancel(embed_id))

    def on_embedded(self, message: WorkerEmbedded) -> None:
        owner = self._owners.pop(message.embed_id, None)
        if owner is None:  # failed already (a worker restart), or cancelled
            tenant, is_first = self._cancelled.pop(message.embed_id, (None, False))
            if tenant is not None and message.num_tokens:
                self._ledger.on_finished(tenant, {"prompt_tokens": message.num_tokens}, time.monotonic(),
                                         int(is_first))
            return
        identity, nonce, tenant, is_first = owner
        del self._ids[identity, nonce]
        self._ledger.release(tenant)
        if not message.code:
            self._ledger.on_finished(tenant, {"prompt_tokens": message.num_tokens}, time.monotonic(), int(is_first))
        if message.code:
            self._clients.send(identity, MsgType.ERROR, {"code": message.code, "message": message.message,
                                                         "nonce": nonce})
            return
        usage = {"prompt_tokens": message.num_tokens, "total_tokens": message.num_tokens}
        self._clients.send(identity, MsgType.EMBED_REPLY, {"nonce": nonce, "embeddings": message.vectors,
                                                           "usage": usage})

    def fail_all(self, code: str, message: str, include_held: bool) -> None:
        """End the requests sent to a worker (and, with include_held, those still here);
        what the worker decoded for the cancelled ones is lost with it."""
        self._cancelled.clear()
        for embed_id in list(self._owners):
            if include_held or embed_id not in self._held:
                self._held.pop(embed_id, None)
                self.on_embedded(WorkerEmbedded(embed_id, code=code, message=message))
