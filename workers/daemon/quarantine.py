"""Request shapes that crashed the decode worker, refused from then on.

A request must never be able to crash the worker (the engine guards every input it knows
of), but if one does, a caller that repeats it must not be able to keep every other
caller's work failing. The worker marks the request it is inside llama.cpp for, alone (its
sampling, its preparation), in the ring's header; when the worker dies with such a mark,
that request's shape is quarantined here. A shape is the request's parameters without its
text and scheduling (prompt or messages, seed, priority, timeout): the same parameters
with another prompt crash the same way. The set lives as long as the daemon and holds at
most MAX_SHAPES (the oldest go first).
"""

import hashlib
import json
from collections import OrderedDict

from cbatch.errors import CbatchError, INVALID_REQUEST

MAX_SHAPES = 1024
_NOT_SHAPE = frozenset({"prompt", "messages", "seed", "priority", "timeout"})
QUARANTINED_MESSAGE = ("a request with these parameters (whatever its prompt) made the decode worker crash, so the "
                       "daemon refuses them until it restarts; change grammar, min_tokens, logit_bias or the sampling "
                       "fields, and report the request")


def shape_fields(body: dict) -> dict:
    """The body's parameters: what makes its shape."""
    return {key: value for key, value in body.items() if key not in _NOT_SHAPE}


def request_shape(fields: dict) -> bytes:
    """A digest of shape_fields, whatever order the caller wrote them in."""
    return hashlib.blake2b(json.dumps(fields, sort_keys=True, default=repr).encode(), digest_size=16).digest()


class Quarantine:
    def __init__(self):
        self._shapes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._shapes)

    def add(self, fields: dict) -> None:
        self._shapes[request_shape(fields)] = None
        while len(self._shapes) > MAX_SHAPES:
            self._shapes.popitem(last=False)

    def admit(self, body: dict) -> dict:
        """The body's shape fields, kept in case it crashes the worker; raises the refusal
        when that shape is quarantined. Digested only while something is quarantined: the
        digest (a sorted JSON encoding) was a tenth of the front-end's CPU per request."""
        fields = shape_fields(body)
        if self._shapes and request_shape(fields) in self._shapes:
            raise CbatchError(INVALID_REQUEST, QUARANTINED_MESSAGE)
        return fields
