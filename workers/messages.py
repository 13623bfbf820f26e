"""The messages between the front-end and the decode worker: one small struct per type.

On the wire each is [type byte, msgpack array of its fields in order] (cbatch.protocol's
framing): a msgspec Struct, encoded and decoded, types checked, in C, with no field names
on the wire. A struct grows by a field with a default at the end; both ends are always the
same version (the supervisor starts the worker from its own install). A step's token
events travel as the records the worker wrote to the ring, one bytes field: the front-end
keeps and relays those bytes, never a per-token object. (The client boundary stays msgpack
maps: clients of other versions and languages speak it.)
"""

import msgspec
import numpy as np
from msgspec import field

from cbatch.ipc.records import TokenEvent
from cbatch.params import Request
from cbatch.protocol import MsgType, ProtocolError, split_frames


class _Message(msgspec.Struct, array_like=True):
    """A worker message: its fields, in order, are its msgpack array."""


class WorkerReady(_Message):
    pid: int
    model: str
    ctx_per_seq: int
    prefix_cache: str
    reasoning: dict | None = None  # workers/engine/thinking/tags.py: the tags the model thinks in
    chat: dict = field(default_factory=dict)  # the model's chat and input facts: relayed to clients in WELCOME


class WorkerFailed(_Message):
    """The worker cannot start (model, context, ring); it exits next."""

    message: str
    code: str  # INVALID_CONFIG: a setting is wrong and a restart cannot help


class WorkerSubmit(_Message):
    request: Request  # as the front-end parsed and checked it, its tenant's weight set from the keys file
    deadline_s: float = 0.0  # when it must end, on the host's monotonic clock (the front-end's daemon default
    #                          applied); 0 = never

    @property
    def request_id(self) -> int:
        return self.request.request_id


class WorkerCancel(_Message):
    request_id: int
    # The drain's cancel, not the caller's: the request ends with the error shutting_down
    # (a transient refusal, which batch paths send again), never as `cancelled`.
    is_shutdown: bool = False


class WorkerPause(_Message):
    """Back-pressure: a request whose records wait for a slow client past a bound leaves the
    steps (keeping its slot and KV) until told to go on (workers/daemon/backlog.py)."""

    request_id: int
    is_paused: bool


class WorkerStop(_Message):
    pass


class WorkerReject(_Message):
    request_id: int
    code: str
    message: str


class WorkerEmbed(_Message):
    embed_id: int
    inputs: list  # strings and token-id lists (cbatch.embeddings.parse_inputs checked them)
    dimensions: int = 0  # the size asked for; 0 = the model's own


class WorkerEmbedCancel(_Message):
    """The caller of a WorkerEmbed has gone: none of its inputs is decoded from now on. Its one
    WorkerEmbedded (the cancel's, without vectors, or the finished one already sent) says the
    tokens decoded for it."""

    embed_id: int


class WorkerEmbedded(_Message):
    """The vectors of a WorkerEmbed, in input order (float32 little-endian bytes, L2-normalized),
    or its error (a non-empty code)."""

    embed_id: int
    vectors: list[bytes] = field(default_factory=list)
    num_tokens: int = 0
    code: str = ""
    message: str = ""


class WorkerCount(_Message):
    """How many tokens the request's prompt is as the model sees it (its chat template
    applied, each image's positions counted); nothing runs."""

    count_id: int
    request: Request


class WorkerCounted(_Message):
    """A WorkerCount's answer, or its error (a non-empty code)."""

    count_id: int
    num_tokens: int = 0
    code: str = ""
    message: str = ""


class WorkerEvents(_Message):
    """One step's output: its records as written to the ring (RECORD_DTYPE rows, in event
    order), the end of each request it finished, and the logprobs of the requests that
    asked. Built by `of_step`, the one place events become this message."""

    records: bytes
    ends: list = field(default_factory=list)  # [request_id, finish_reason, usage, error, error_code, stop_string]
    logprobs: list = field(default_factory=list)  # [request_id, index of its first token record, entries]
    stats: dict | None = None  # the engine's snapshot, at most every STATS_INTERVAL_S

    @classmethod
    def of_step(cls, events: list[TokenEvent], framed: np.ndarray, stats: dict | None = None) -> "WorkerEvents":
        """framed: the events' records (frame_events); an event's token records come first,
        so its logprobs entries belong to the records from its index on."""
        ends = [[event.request_id, event.finish_reason, event.usage, event.error, event.error_code, event.stop_string]
                for event in events if event.finish_reason]
        logprobs = [[event.request_id, event.index, event.logprobs] for event in events if event.logprobs]
        return cls(framed.tobytes(), ends, logprobs, stats)


_TYPES = {
    WorkerReady: MsgType.WORKER_READY, WorkerFailed: MsgType.WORKER_FAILED, WorkerSubmit: MsgType.WORKER_SUBMIT,
    WorkerCancel: MsgType.WORKER_CANCEL, WorkerStop: MsgType.WORKER_STOP, WorkerReject: MsgType.WORKER_REJECT,
    WorkerEvents: MsgType.WORKER_EVENTS, WorkerEmbed: MsgType.WORKER_EMBED, WorkerEmbedded: MsgType.WORKER_EMBEDDED,
    WorkerPause: MsgType.WORKER_PAUSE, WorkerEmbedCancel: MsgType.WORKER_EMBED_CANCEL,
    WorkerCount: MsgType.WORKER_COUNT, WorkerCounted: MsgType.WORKER_COUNTED,
}
_CLASSES = {msg_type: cls for cls, msg_type in _TYPES.items()}


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {msg_type: msgspec.msgpack.Decoder(cls) for msg_type, cls in _CLASSES.items()}


def encode(message: _Message) -> list[bytes]:
    return [bytes((_TYPES[type(message)],)), _ENCODER.encode(message)]


def decode(frames: list[bytes]):
    """The struct a worker or front-end sent; both ends are ours, so a malformed message
    is a bug and raises (ProtocolError, TypeError)."""
    msg_type, body = split_frames(frames)
    decoder = _DECODERS.get(msg_type)
    if decoder is None:
        raise TypeError(f"{msg_type.name} is not a worker message")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as err:
        raise TypeError(f"{msg_type.name}: {err}") from None
    except msgspec.DecodeError as err:
        raise ProtocolError(f"{msg_type.name}: body is not valid msgpack: {err}") from None
