"""JSON in and out of the HTTP server: request bodies parsed, response bodies and
server-sent events encoded, all with orjson (a C codec: every request and every streamed
chunk passes through here, so its speed is the server's).

What orjson does differently from the json module, and why it is safe here:
- it writes a float that is not finite (a logprob of a -inf logit) as null, where
  json.dumps wrote NaN or -Infinity, which no strict JSON parser reads: the body stays JSON;
- it refuses a dict key that is not a str and an int beyond 64 bits: the bodies are built
  of str keys, and their ints are counts, ids and timestamps, or come from a request body
  that orjson parsed (which reads an int beyond 64 bits as a float);
- it reads no NaN or Infinity in a request body (they are not JSON): a 400, as for any
  other body that is not JSON.
"""

import orjson
from starlette.responses import Response

from cbatch.errors import INVALID_REQUEST, CbatchError

# numpy scalars and arrays as numbers and lists (json.dumps took numpy's float64, a float subclass)
_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
# orjson's message for a body nested deeper than it reads (1024 levels)
_DEPTH_LIMIT_MESSAGE = "depth limit exceeded"


def json_bytes(obj) -> bytes:
    """The compact UTF-8 JSON of a response body (no spaces, characters as they are)."""
    return orjson.dumps(obj, option=_OPTIONS)


def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json_bytes(obj), status, headers, media_type="application/json")


def sse(obj) -> bytes:
    """A chat or completions stream's event (OpenAI's events carry no name)."""
    return b"data: " + json_bytes(obj) + b"\n\n"


def sse_event(event: dict) -> bytes:
    """A Responses stream event: its type as the SSE event name, as OpenAI sends it."""
    return b"event: " + event["type"].encode() + b"\ndata: " + json_bytes(event) + b"\n\n"


def json_body(body: bytes):
    """The request's JSON; a body that is not (bad syntax, not UTF-8, nested too deep for
    the parser) is the caller's error, a 400, never a traceback."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise CbatchError(INVALID_REQUEST, _why_not_json(body, err)) from None


def _why_not_json(body: bytes, err: orjson.JSONDecodeError) -> str:
    """The reason a caller can act on. Worked out only for a body already refused, so
    checking its UTF-8 again costs a good request nothing."""
    try:
        body.decode()
    except UnicodeDecodeError:
        return "the body is not UTF-8 text"
    if err.msg == _DEPTH_LIMIT_MESSAGE:
        return "the body's JSON is nested too deep"
    return f"the body is not JSON: {err.msg}"
