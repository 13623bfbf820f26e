"""The messages between the front-end and the decode worker: one small struct per type.

On the wire each is [type byte, msgpack map of its fields] (cbatch.protocol's framing).
A struct grows by a field with a default at the end; both ends are always the same
version (the supervisor starts the worker from its own install), so no field is ever
optional on the wire. Token events (cbatch.ipc.records) travel as lists in field order: a step of 64
sequences is 64 of them, and map keys would be most of the bytes.
"""

from dataclasses import dataclass, field, fields
from operator import attrgetter

from cbatch.ipc.records import TokenEvent
from cbatch.protocol import MsgType, pack, unpack


@dataclass
class WorkerReady:
    pid: int
    model: str
    ctx_per_seq: int
    prefix_cache: str
    reasoning: dict | None = None  # workers/engine/reasoning.py: the tags the model thinks in
    chat: dict = field(default_factory=dict)  # workers/engine/chat_texts.py: relayed to clients in WELCOME


@dataclass
class WorkerFailed:
    """The worker cannot start (model, context, ring); it exits next."""

    message: str
    code: str  # INVALID_CONFIG: a setting is wrong and a restart cannot help


@dataclass
class WorkerSubmit:
    request_id: int
    body: dict
    deadline_s: float = 0.0  # when it must end, on the host's monotonic clock (the front-end's daemon default
    #                          applied); 0 = never


@dataclass
class WorkerCancel:
    request_id: int


@dataclass
class WorkerStop:
    pass


@dataclass
class WorkerReject:
    request_id: int
    code: str
    message: str


@dataclass
class WorkerEmbed:
    embed_id: int
    inputs: list  # strings and token-id lists (cbatch.embeddings.parse_inputs checked them)
    dimensions: int = 0  # the size asked for; 0 = the model's own


@dataclass
class WorkerEmbedded:
    """The vectors of a WorkerEmbed, in input order (float32 little-endian bytes, L2-normalized),
    or its error (a non-empty code)."""

    embed_id: int
    vectors: list[bytes] = field(default_factory=list)
    num_tokens: int = 0
    code: str = ""
    message: str = ""


@dataclass
class WorkerEvents:
    events: list[TokenEvent] = field(default_factory=list)
    stats: dict | None = None  # the engine's snapshot, at most every STATS_INTERVAL_S


_TYPES = {
    WorkerReady: MsgType.WORKER_READY, WorkerFailed: MsgType.WORKER_FAILED, WorkerSubmit: MsgType.WORKER_SUBMIT,
    WorkerCancel: MsgType.WORKER_CANCEL, WorkerStop: MsgType.WORKER_STOP, WorkerReject: MsgType.WORKER_REJECT,
    WorkerEvents: MsgType.WORKER_EVENTS, WorkerEmbed: MsgType.WORKER_EMBED, WorkerEmbedded: MsgType.WORKER_EMBEDDED,
}
_CLASSES = {msg_type: cls for cls, msg_type in _TYPES.items()}
_EVENT_ROW = attrgetter(*(f.name for f in fields(TokenEvent)))  # an event's fields in order, as a tuple


def encode(message) -> list[bytes]:
    body = {f.name: getattr(message, f.name) for f in fields(message)}
    if isinstance(message, WorkerEvents):
        body["events"] = [_EVENT_ROW(event) for event in message.events]
    return pack(_TYPES[type(message)], body)


def decode(frames: list[bytes]):
    """The struct a worker or front-end sent; both ends are ours, so a malformed message
    is a bug and raises (ProtocolError, TypeError)."""
    msg_type, body = unpack(frames)
    cls = _CLASSES.get(msg_type)
    if cls is None:
        raise TypeError(f"{msg_type.name} is not a worker message")
    if cls is WorkerEvents:
        body["events"] = [TokenEvent(*row) for row in body["events"]]
    return cls(**body)
