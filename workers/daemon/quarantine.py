"""Request shapes that crashed the decode worker, refused from then on.

A request must never be able to crash the worker (the engine guards every input it knows
of), but if one does, a caller that repeats it must not be able to keep every other
caller's work failing. The worker marks the request it is inside llama.cpp for, alone (its
sampling, its preparation), in the ring's header; when the worker dies with such a mark,
that request's shape is quarantined here. A shape is the request's sampling parameters as
parsed, defaults filled in, without its seed (and without its text and scheduling): the
same parameters with another prompt crash the same way, and spelling a default out or
writing 1 for 1.0 makes no other shape. The set lives as long as the daemon and holds at
most MAX_SHAPES (the oldest go first).
"""

import dataclasses
import hashlib
import json
from collections import OrderedDict

from cbatch.errors import CbatchError, INVALID_REQUEST
from cbatch.params import Request, SamplingParams

MAX_SHAPES = 1024
QUARANTINED_MESSAGE = ("a request with these parameters (whatever its prompt) made the decode worker crash, so the "
                       "daemon refuses them until it restarts; change grammar, min_tokens, logit_bias or the sampling "
                       "fields, and report the request")


_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "seed")


def shape_fields(params: SamplingParams) -> dict:
    """The sampling parameters but the seed: what makes a request's shape."""
    return {name: getattr(params, name) for name in _SHAPE_FIELDS}


def request_shape(fields: dict) -> bytes:
    """A digest of shape_fields, whatever order the caller wrote them in."""
    return hashlib.blake2b(json.dumps(fields, sort_keys=True, default=repr).encode(), digest_size=16).digest()


class Quarantine:
    def __init__(self):
        self._shapes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._shapes)

    def add(self, params: SamplingParams) -> None:
        self._shapes[request_shape(shape_fields(params))] = None
        while len(self._shapes) > MAX_SHAPES:
            self._shapes.popitem(last=False)

    def admit(self, request: Request) -> SamplingParams:
        """The request's parameters, kept in case it crashes the worker; raises the refusal
        when their shape is quarantined. Digested only while something is quarantined: the
        digest (a sorted JSON encoding) was a tenth of the front-end's CPU per request."""
        if self._shapes and request_shape(shape_fields(request.params)) in self._shapes:
            raise CbatchError(INVALID_REQUEST, QUARANTINED_MESSAGE)
        return request.params
