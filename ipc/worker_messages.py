"""The messages between the front-end and the decode worker: one small struct per type.

On the wire each is [type byte, msgpack map of its fields] (cbatch.protocol's framing).
A struct grows by a field with a default at the end; both ends are always the same
version (the supervisor starts the worker from its own install), so no field is ever
optional on the wire. A step's token events travel as the records the worker wrote to the
ring, one bytes field: the front-end keeps and relays those bytes, never a per-token object.
"""

from dataclasses import dataclass, field, fields

import numpy as np

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
    request: list  # cbatch.params.request_fields: the front-end parsed and checked it
    deadline_s: float = 0.0  # when it must end, on the host's monotonic clock (the front-end's daemon default
    #                          applied); 0 = never


@dataclass
class WorkerCancel:
    request_id: int
    # The drain's cancel, not the caller's: the request ends with the error shutting_down
    # (a transient refusal, which batch paths send again), never as `cancelled`.
    is_shutdown: bool = False


@dataclass
class WorkerPause:
    """Back-pressure: a request whose records wait for a slow client past a bound leaves the
    steps (keeping its slot and KV) until told to go on (workers/daemon/backlog.py)."""

    request_id: int
    is_paused: bool


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
class WorkerEmbedCancel:
    """The caller of a WorkerEmbed has gone: none of its inputs is decoded from now on; no reply."""

    embed_id: int


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
    """One step's output: its records as written to the ring (RECORD_DTYPE rows, in event
    order), the end of each request it finished, and the logprobs of the requests that
    asked. Built by `of_step`, the one place events become this message."""

    records: bytes
    ends: list = field(default_factory=list)  # [request_id, finish_reason, usage, error, error_code]
    logprobs: list = field(default_factory=list)  # [request_id, index of its first token record, entries]
    stats: dict | None = None  # the engine's snapshot, at most every STATS_INTERVAL_S

    @classmethod
    def of_step(cls, events: list[TokenEvent], framed: np.ndarray, stats: dict | None = None) -> "WorkerEvents":
        """framed: the events' records (frame_events); an event's token records come first,
        so its logprobs entries belong to the records from its index on."""
        ends = [[event.request_id, event.finish_reason, event.usage, event.error, event.error_code]
                for event in events if event.finish_reason]
        logprobs = [[event.request_id, event.index, event.logprobs] for event in events if event.logprobs]
        return cls(framed.tobytes(), ends, logprobs, stats)


_TYPES = {
    WorkerReady: MsgType.WORKER_READY, WorkerFailed: MsgType.WORKER_FAILED, WorkerSubmit: MsgType.WORKER_SUBMIT,
    WorkerCancel: MsgType.WORKER_CANCEL, WorkerStop: MsgType.WORKER_STOP, WorkerReject: MsgType.WORKER_REJECT,
    WorkerEvents: MsgType.WORKER_EVENTS, WorkerEmbed: MsgType.WORKER_EMBED, WorkerEmbedded: MsgType.WORKER_EMBEDDED,
    WorkerPause: MsgType.WORKER_PAUSE, WorkerEmbedCancel: MsgType.WORKER_EMBED_CANCEL,
}
_CLASSES = {msg_type: cls for cls, msg_type in _TYPES.items()}


def encode(message) -> list[bytes]:
    return pack(_TYPES[type(message)], {f.name: getattr(message, f.name) for f in fields(message)})


def decode(frames: list[bytes]):
    """The struct a worker or front-end sent; both ends are ours, so a malformed message
    is a bug and raises (ProtocolError, TypeError)."""
    msg_type, body = unpack(frames)
    cls = _CLASSES.get(msg_type)
    if cls is None:
        raise TypeError(f"{msg_type.name} is not a worker message")
    return cls(**body)
