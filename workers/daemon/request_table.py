"""The front-end's table of requests: who owns each, its lifecycle, and how long it is kept.

Pure bookkeeping, no sockets. A request is active from its submit until its finish (or
until it is failed), then retained for `retention_s` so that a reader the ring lapped can
fetch its records and a client that missed its finish can have it again. Invariants: a
request id is in at most one of `active` and the retained set; `owed` names only
retained requests whose finish could not be sent to their owner; `num_active_by_priority`
counts `active` by is_batch. Each priority has its own bound on requests in flight, so
batch work never makes an interactive request see queue_full. Each active request counts
in its tenant's ledger (tenant_ledger.py) from add to its end, and a finished one is
charged there.
"""

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from cbatch.api_keys import DEFAULT_TENANT
from cbatch.config import QUEUE_FLAGS
from cbatch.errors import INVALID_REQUEST, NOT_FOUND, QUEUE_FULL, CbatchError
from cbatch.ipc.records import RECORD_SIZE_BYTES
from cbatch.params import PRIORITIES, SamplingParams
from cbatch.wording import counted
from cbatch.workers.daemon.tenant_ledger import TenantLedger


@dataclass(eq=False)
class TrackedRequest:
    """A request as the front-end tracks it, from its submit until its retention ends."""

    request_id: int
    owner: bytes  # the client's ROUTER identity
    is_relayed: bool  # the owner reads records over ZeroMQ instead of the ring
    submit: list[bytes] | None = None  # its WorkerSubmit, encoded: kept only until it reaches a ready worker
    finish: dict | None = None  # the FINISHED body, once finished (resent on request)
    records: bytearray = field(default_factory=bytearray)  # its records so far, framed as in the ring
    finished_at_s: float | None = None
    logprobs: dict[int, list] | None = None  # token record index -> logprobs entry, when the request asked
    is_batch: bool = False  # priority "batch": handed to a worker after the interactive requests held with it
    deadline_s: float = 0.0  # monotonic clock; 0 = none
    shape: SamplingParams | None = None  # its parameters, kept in case it crashes the worker (quarantine.py)
    fingerprint: int | None = None  # the exact request, kept in case it is a crash's suspect (probation.py)
    tenant: str = DEFAULT_TENANT
    reserved_tokens: int = 0  # held in its tenant's tokens_per_min bucket until it ends (tenant_ledger.py)
    # Why the worker holds it paused: its records pile up in the front-end's backlog for its
    # client, or its client holds more of it than its caller took. Paused while any holds.
    pause_reasons: set[str] = field(default_factory=set)

    @property
    def is_held(self) -> bool:
        """Not yet handed to a worker (none was ready): nothing has run."""
        return self.submit is not None

    @property
    def num_records(self) -> int:
        return len(self.records) // RECORD_SIZE_BYTES


class RequestTable:
    def __init__(self, max_in_flight: tuple[int, int], retention_s: float, ledger: TenantLedger | None = None):
        self.max_in_flight = max_in_flight  # by is_batch: (interactive, batch)
        self.ledger = ledger or TenantLedger()
        self.retention_s = retention_s
        self.active: dict[int, TrackedRequest] = {}
        self.num_active_by_priority = [0, 0]  # by is_batch
        self._retained: OrderedDict[int, TrackedRequest] = OrderedDict()  # in finishing order
        self._owed: dict[bytes, dict[int,
                                     TrackedRequest]] = {}  # owner -> retained tracked_requests whose finish it lacks
        self.num_ended_by_outcome: Counter = Counter()  # finish reason, or the error code it failed with

    def add(self, tracked: TrackedRequest, now_s: float = 0.0) -> None:
        """Raises (nothing changes) on a used id, a full priority, a tenant past its limits."""
        if tracked.request_id in self.active or tracked.request_id in self._retained:
            raise CbatchError(INVALID_REQUEST, f"request_id {tracked.request_id} is already in use")
        is_batch = tracked.is_batch
        if self.num_active_by_priority[is_batch] >= self.max_in_flight[is_batch]:
            in_flight = counted(self.max_in_flight[is_batch], f"{PRIORITIES[is_batch]} request")
            raise CbatchError(QUEUE_FULL, f"{in_flight} in flight; retry later or raise {QUEUE_FLAGS[is_batch]}")
        max_tokens = tracked.shape.max_tokens if tracked.shape is not None else 0
        tracked.reserved_tokens = self.ledger.admit(tracked.tenant, now_s, max_tokens=max_tokens)
        self.active[tracked.request_id] = tracked
        self.num_active_by_priority[is_batch] += 1

    def get(self, request_id) -> TrackedRequest | None:
        return self.active.get(request_id) or self._retained.get(request_id)

    def owned(self, owner: bytes, request_id) -> TrackedRequest:
        """The owner's request, active or retained; NOT_FOUND for anyone else's."""
        tracked = self.get(request_id)
        if tracked is None or tracked.owner != owner:
            raise CbatchError(NOT_FOUND, f"no request {request_id} of yours is known")
        return tracked

    def active_of(self, owner: bytes) -> list[TrackedRequest]:
        return [tracked for tracked in self.active.values() if tracked.owner == owner]

    def finish(self, tracked: TrackedRequest, finish: dict, now_s: float) -> None:
        """The request ended with `finish` (the FINISHED body): retain it, forget the expired."""
        tracked.finish, tracked.finished_at_s = finish, now_s
        self._remove_active(tracked)
        self.ledger.on_finished(tracked.tenant, finish.get("usage") or {}, now_s, reserved=tracked.reserved_tokens)
        self.num_ended_by_outcome[finish["finish_reason"]] += 1
        self._retained[tracked.request_id] = tracked
        self.expire(now_s)

    def expire(self, now_s: float) -> None:
        """Forget the retained requests that finished more than retention_s ago."""
        while self._retained and next(iter(self._retained.values())).finished_at_s < now_s - self.retention_s:
            _, old = self._retained.popitem(last=False)
            self._set_owed(old, False)

    def fail(self, tracked: TrackedRequest, code: str, now_s: float) -> None:
        """The request ended with an error reply: nothing of it is kept, nothing charged."""
        self.ledger.refund(tracked.tenant, tracked.reserved_tokens, now_s)
        self._remove_active(tracked)
        self.num_ended_by_outcome[code] += 1

    def _remove_active(self, tracked: TrackedRequest) -> None:
        del self.active[tracked.request_id]
        self.num_active_by_priority[tracked.is_batch] -= 1
        self.ledger.release(tracked.tenant)

    def set_delivered(self, tracked: TrackedRequest, is_delivered: bool) -> None:
        self._set_owed(tracked, not is_delivered)

    def owed_to(self, owner: bytes) -> list[TrackedRequest]:
        return list(self._owed.get(owner, {}).values())

    def _set_owed(self, tracked: TrackedRequest, is_owed: bool) -> None:
        owed = self._owed.setdefault(tracked.owner, {})
        if is_owed:
            owed[tracked.request_id] = tracked
        else:
            owed.pop(tracked.request_id, None)
        if not owed:
            del self._owed[tracked.owner]
