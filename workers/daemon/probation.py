"""Requests on probation: suspects of a decode worker crash that no one request could be blamed for.

A crash inside llama_decode (or with several requests marked, or none) does not say which
request caused it (crash_blame.py). Its suspects fail with `worker_restarted` like every
request of the dead worker, and their fingerprints go on probation. A request on probation
that is submitted again is handed to the worker only while no other request on probation
is in it (the others are held in the front-end, in arrival order, until its turn ends): so a
poison request crashes the worker again alone among the suspects, and is then quarantined
exactly (quarantine.py), while the innocents it shared a batch with are resent and complete.
A request on probation that finishes in the worker leaves probation. A turn lasts at most
TURN_S: a request that is still in the worker then (its reader paused it, or it generates
for long) lets the next one in, so no caller holds the others' turns; it stays on probation
until it finishes. At most MAX_PROBATION_REQUESTS fingerprints are kept (the oldest go first).

A fingerprint is the exact request (prompt or messages, every parameter, tenant) without its
id or deadline: Python's hash of the bytes the front-end encodes for the worker anyway, taken
once at admission. Measured (tests/test_crash_blame.py, -s prints it): 1-2 us for a short
prompt against 25 us to parse and encode it, 0.4 ms for a 1 MB prompt against 0.33 ms. Python's hash is keyed
per process, so a caller cannot aim a collision at another's request; fingerprints never
leave the front-end's process.
"""

import time
from collections import OrderedDict

import msgpack

from cbatch.workers.daemon.quarantine import add_bounded
from cbatch.workers.daemon.request_table import TrackedRequest
from cbatch.workers.messages import WorkerSubmit

MAX_PROBATION_REQUESTS = 4096
# A turn long enough for a poison request's prefill and first tokens, in which its crashes
# come (a crash later, beside another turn's request, puts both on probation again).
TURN_S = 30.0


def request_fingerprint(submit: WorkerSubmit, body_frame: bytes) -> int:
    """The hash of submit.request's encoding inside body_frame (encode(submit)'s body) but
    its id. Both structs are arrays of their fields in order (workers/messages.py, params.py):
    a one-byte header for the submit's two fields, one for the request's nine, the request
    id, the request's other fields, the deadline; so the fingerprint's bytes are those
    between the encoded request id and the encoded deadline, each encoded as msgpack
    encodes it (the smallest integer form, a float as 64 bits)."""
    start = 2 + len(msgpack.packb(submit.request_id))
    end = len(body_frame) - len(msgpack.packb(submit.deadline_s))
    return hash(memoryview(body_frame)[start:end])


class Probation:
    """Which fingerprints are on probation, the one such request in the worker, and those held
    for their turn. `active` is the request table's dict of active requests (read only)."""

    def __init__(self, active: dict[int, TrackedRequest], clock=time.monotonic):
        self._active, self._clock = active, clock
        self._fingerprints: OrderedDict[int, None] = OrderedDict()
        self._in_worker: TrackedRequest | None = None  # the one request on probation whose turn it is
        self._turn_ends_s = 0.0
        self._turn_over: dict[int, TrackedRequest] = {}  # request id -> still in the worker after its turn
        self._waiting: dict[int, TrackedRequest] = {}  # request id -> held for its turn, in arrival order

    def __contains__(self, fingerprint: int) -> bool:
        return fingerprint in self._fingerprints

    def __len__(self) -> int:
        return len(self._fingerprints)

    def put(self, fingerprints) -> None:
        for fingerprint in fingerprints:
            add_bounded(self._fingerprints, fingerprint, MAX_PROBATION_REQUESTS)

    def take_turn(self, tracked: TrackedRequest) -> bool:
        """Whether the held request may go to the worker now: it is not on probation, or no
        other request on probation is in the worker (then it is). Otherwise it waits."""
        if tracked.fingerprint not in self._fingerprints:
            return True
        if self._is_turn_free():
            self._waiting.pop(tracked.request_id, None)
            self._in_worker, self._turn_ends_s = tracked, self._clock() + TURN_S
            return True
        self._waiting.setdefault(tracked.request_id, tracked)
        return False

    def next_turn(self) -> list[TrackedRequest]:
        """The first request still held for its turn, once the turn is free (none: [])."""
        while self._is_turn_free() and self._waiting:
            tracked = self._waiting.pop(next(iter(self._waiting)))
            if tracked.is_held and self._active.get(tracked.request_id) is tracked:
                return [tracked]
        return []

    def _is_turn_free(self) -> bool:
        """No request on probation has its turn in the worker. One that ended with a finish
        (the worker survived it) leaves probation; one that failed (a crash) stays."""
        for request_id, tracked in list(self._turn_over.items()):
            if self._active.get(request_id) is not tracked:
                del self._turn_over[request_id]
                self._on_ended(tracked)
        tracked = self._in_worker
        if tracked is None:
            return True
        if self._active.get(tracked.request_id) is tracked:
            if self._clock() < self._turn_ends_s:
                return False
            self._turn_over[tracked.request_id] = tracked
        else:
            self._on_ended(tracked)
        self._in_worker = None
        return True

    def _on_ended(self, tracked: TrackedRequest) -> None:
        if tracked.finish is not None:
            self._fingerprints.pop(tracked.fingerprint, None)
