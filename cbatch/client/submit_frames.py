"""A request body as the SUBMIT frames the front-end takes: encoded and checked here, so
that what the front-end would refuse fails in the caller's own call, saying why."""

from cbatch.errors import INVALID_REQUEST, CbatchError
from cbatch.protocol import MAX_FRAME_BYTES, MsgType, ProtocolError, pack, unpack


def submit_frames(request_id: int, body: dict) -> list[bytes]:
    try:
        frames = pack(MsgType.SUBMIT, {"request_id": request_id, "body": body})
    except (TypeError, ValueError, OverflowError) as err:
        raise CbatchError(INVALID_REQUEST, f"the request cannot be encoded: {err}") from None
    if len(frames[1]) > MAX_FRAME_BYTES:
        raise CbatchError(INVALID_REQUEST, f"the request is {len(frames[1])} bytes; the limit is {MAX_FRAME_BYTES}")
    try:
        unpack(frames)  # what the front-end would refuse (non-string keys, nesting) fails here, named
    except ProtocolError as err:
        raise CbatchError(INVALID_REQUEST, f"the request cannot be sent: {err}") from None
    return frames
