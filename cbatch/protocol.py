"""The wire protocol: multipart ZeroMQ messages of [type byte, msgpack body].

Plain data only (msgpack maps of str, int, float, bytes, lists); no pickle anywhere.
Unpacking is bounded in size and depth, and every body must be a map. This module
imports nothing from the project, so any client can vendor it.
"""

import enum

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 4 << 20  # a body larger than this is rejected before unpacking
MAX_CONTAINER_LEN = 1 << 16  # longest list or map msgpack may build
MAX_STR_BYTES = 2 << 20


class MsgType(enum.IntEnum):
    # client -> front-end
    HELLO = 0x01  # {version, use_ring} -> WELCOME
    SUBMIT = 0x02  # {request_id, body} -> records..., FINISHED (or ERROR with request_id)
    CANCEL = 0x03  # {request_id}
    FETCH = 0x04  # {request_id, from_index} -> RECORDS (ring overrun recovery)
    HEALTH = 0x05  # {nonce} -> HEALTH_REPLY
    STATS = 0x06  # {nonce} -> STATS_REPLY
    EMBED = 0x07  # {nonce, input: [str | [token id]], dimensions?} -> EMBED_REPLY (or ERROR with nonce)
    EMBED_CANCEL = 0x08  # {nonce}: the caller of that EMBED has gone; no reply
    PAUSE = 0x09  # {request_id, is_paused}: the client holds more of it than its caller took; no reply
    COUNT = 0x0A  # {nonce, body}: a request's prompt tokens, as the model sees it -> COUNT_REPLY (or ERROR)
    # front-end -> client
    WELCOME = 0x21  # {version, model, parallel, ctx_per_seq, ring_name, tick_endpoint, use_ring[, tool_format,
    #                 takes_images, n_ctx_train, keeps_billing_header]}: sent again when the worker is (re)ready
    RECORDS = 0x22  # {request_id, records: [[index, token_id, flags, finish, count, text], ...]}
    FINISHED = 0x23  # {request_id, finish_reason, usage, num_records, error[, stop_string]}
    ERROR = 0x24  # {code, message, request_id?, nonce?}
    HEALTH_REPLY = 0x25
    STATS_REPLY = 0x26
    EMBED_REPLY = 0x27  # {nonce, embeddings: [float32 little-endian bytes], usage: {prompt_tokens, total_tokens}}
    COUNT_REPLY = 0x28  # {nonce, num_tokens}
    # front-end <-> decode worker: the bodies are the structs of cbatch.workers.messages
    WORKER_READY = 0x41
    WORKER_SUBMIT = 0x42
    WORKER_CANCEL = 0x43
    WORKER_EVENTS = 0x44
    WORKER_REJECT = 0x45
    WORKER_STOP = 0x46
    WORKER_FAILED = 0x47
    WORKER_EMBED = 0x48
    WORKER_EMBEDDED = 0x49
    WORKER_PAUSE = 0x4A
    WORKER_EMBED_CANCEL = 0x4B
    WORKER_COUNT = 0x4C
    WORKER_COUNTED = 0x4D


class ProtocolError(Exception):
    """A frame that is not a well-formed message of this protocol."""


def pack(msg_type: MsgType, body: dict) -> list[bytes]:
    return [bytes((msg_type,)), msgpack.packb(body, use_bin_type=True)]


def split_frames(frames: list[bytes]) -> tuple[MsgType, bytes]:
    """[type, body] checked and split, the body not parsed; raise ProtocolError for anything else."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames (type, body), got {len(frames)}")
    type_frame, body_frame = frames
    if len(type_frame) != 1:
        raise ProtocolError("the type frame must be exactly one byte")
    try:
        msg_type = MsgType(type_frame[0])
    except ValueError:
        raise ProtocolError(f"unknown message type 0x{type_frame[0]:02x}") from None
    if len(body_frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"body of {len(body_frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return msg_type, body_frame


def unpack(frames: list[bytes]) -> tuple[MsgType, dict]:
    """Parse [type, body]; raise ProtocolError for anything else."""
    msg_type, body_frame = split_frames(frames)
    try:
        body = msgpack.unpackb(
            body_frame,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=MAX_STR_BYTES,
            max_array_len=MAX_CONTAINER_LEN,
            max_map_len=MAX_CONTAINER_LEN,
            max_ext_len=0,
        )
    except RecursionError:
        raise ProtocolError("body nests too deeply") from None
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ProtocolError(f"body is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError("body must be a map")
    return msg_type, body


def reply_ids(frames: list) -> dict:
    """The request_id and nonce of a message that failed validation, where a lenient read
    finds them (a body with a non-string key, say), so that the error reply names them."""
    try:
        body = msgpack.unpackb(frames[1], raw=False, strict_map_key=False, max_str_len=MAX_STR_BYTES,
                               max_bin_len=MAX_STR_BYTES, max_array_len=MAX_CONTAINER_LEN,
                               max_map_len=MAX_CONTAINER_LEN, max_ext_len=0)
    except Exception:  # anything unreadable: there is nothing to name
        return {}
    if not isinstance(body, dict):
        return {}
    return {key: body[key] for key in ("request_id", "nonce") if key in body}


def field(body: dict, name: str, kind: type | tuple, *, optional: bool = False):
    """Fetch a typed field; bool is never accepted where an int is asked for."""
    if name not in body:
        if optional:
            return None
        raise ProtocolError(f"missing field {name!r}")
    value = body[name]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ProtocolError(f"field {name!r} must be {kind}, got bool")
    if not isinstance(value, kind):
        raise ProtocolError(f"field {name!r} has the wrong type {type(value).__name__}")
    return value
