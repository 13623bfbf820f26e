"""Requests that crashed the decode worker, refused from then on.

A request must never be able to crash the worker (the engine guards every input it knows
of), but if one does, a caller that repeats it must not be able to keep every other
caller's work failing. Who is blamed for a crash is decided in crash_blame.py; what is
refused is kept here:
  * shapes: a request the worker was inside native code for alone (its sampling, its
    preparation) crashed it, and its shape is refused. A shape is the request's sampling
    parameters as parsed, defaults filled in, without its seed (and without its text and
    scheduling): the same parameters with another prompt crash the same way, and spelling
    a default out or writing 1 for 1.0 makes no other shape.
  * exact requests: one that was among the suspects of two crashes (probation.py), by its
    fingerprint; only the identical request is refused.
Both live as long as the daemon and hold at most MAX_SHAPES and MAX_REQUESTS (the oldest go first).
"""

import hashlib
import json
from collections import OrderedDict

from cbatch.errors import INVALID_REQUEST, CbatchError
from cbatch.params import Request, SamplingParams

MAX_SHAPES = 1024
MAX_REQUESTS = 4096
QUARANTINED_MESSAGE = ("a request with these parameters (whatever its prompt) made the decode worker crash, so the "
                       "daemon refuses them until it restarts; change grammar, min_tokens, logit_bias or the sampling "
                       "fields, and report the request")
CRASHED_TWICE_MESSAGE = ("this exact request was in the decode worker at two of its crashes, so the daemon refuses it "
                         "until it restarts; report the request")


_SHAPE_FIELDS = tuple(name for name in SamplingParams.__struct_fields__ if name != "seed")


def shape_fields(params: SamplingParams) -> dict:
    """The sampling parameters but the seed: what makes a request's shape."""
    return {name: getattr(params, name) for name in _SHAPE_FIELDS}


def request_shape(fields: dict) -> bytes:
    """A digest of shape_fields, whatever order the caller wrote them in."""
    return hashlib.blake2b(json.dumps(fields, sort_keys=True, default=repr).encode(), digest_size=16).digest()


def add_bounded(entries: OrderedDict, key, max_entries: int) -> None:
    """Add (or refresh) key, dropping the oldest entries past max_entries."""
    entries[key] = None
    entries.move_to_end(key)
    while len(entries) > max_entries:
        entries.popitem(last=False)


class Quarantine:
    def __init__(self):
        self._shapes: OrderedDict[bytes, None] = OrderedDict()
        self._requests: OrderedDict[int, None] = OrderedDict()  # fingerprints (probation.py)

    def __len__(self) -> int:
        return len(self._shapes) + len(self._requests)

    def add(self, params: SamplingParams) -> None:
        add_bounded(self._shapes, request_shape(shape_fields(params)), MAX_SHAPES)

    def add_request(self, fingerprint: int) -> None:
        add_bounded(self._requests, fingerprint, MAX_REQUESTS)

    def admit(self, request: Request, fingerprint: int | None = None) -> SamplingParams:
        """The request's parameters, kept in case it crashes the worker; raises the refusal
        when their shape, or this exact request, is quarantined. Digested only while a shape
        is quarantined: the digest (a sorted JSON encoding) was a tenth of the front-end's CPU
        per request."""
        if fingerprint in self._requests:
            raise CbatchError(INVALID_REQUEST, CRASHED_TWICE_MESSAGE)
        if self._shapes and request_shape(shape_fields(request.params)) in self._shapes:
            raise CbatchError(INVALID_REQUEST, QUARANTINED_MESSAGE)
        return request.params
