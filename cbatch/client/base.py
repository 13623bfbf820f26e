"""What both clients share: the endpoint check, request bodies, and everything that does not wait."""

import contextlib
import fcntl
import logging
import os
import time
from dataclasses import dataclass

from cbatch.client.batch_feeder import Choices
from cbatch.client.session import Session
from cbatch.client.streams import Completion, RequestStream
from cbatch.embeddings import MAX_INPUTS_PER_MESSAGE, parse_dimensions, parse_inputs, vector_list
from cbatch.errors import UNAVAILABLE, CbatchError
from cbatch.openai.choices import expand_choices
from cbatch.params import parse_scheduling
from cbatch.tools import JsonAnswer, format_of

CONNECT_TIMEOUT_S = 10.0
STARTING_DAEMON_WAIT_S = 120.0  # for a starting daemon's socket: its imports on a busy machine
STARTING_POLL_S = 0.05
NO_LOCK_GRACE_S = 1.0  # for the lock of a daemon whose process started beside this client's
log = logging.getLogger("cbatch.client")


def unreachable(endpoint: str, is_silent: bool = False) -> CbatchError:
    """is_silent: something is there but never answered the handshake, as a daemon that
    requires CurveZMQ does to a client without its key."""
    hint = ("; a daemon that requires CurveZMQ answers only clients with its public key "
            "(--curve-server-key or CBATCH_CURVE_SERVER_KEY)") if is_silent else ""
    return CbatchError(UNAVAILABLE, f"no cbatch daemon answers at {endpoint}; start cbatch-worker, "
                                    f"or point --endpoint / CBATCH_ENDPOINT at it{hint}")


def _is_daemon_starting(socket_path: str) -> bool:
    """Whether a cbatch-worker holds the lock beside the socket: it takes it first thing,
    seconds before it binds the socket (workers/daemon/endpoint_lock.py)."""
    try:
        fd = os.open(socket_path + ".lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the shared lock, if it was taken


def check_endpoint(endpoint: str) -> None:
    """An ipc:// endpoint with no socket file cannot answer: fail now instead of after a
    timeout, unless a daemon is starting there (say, started in the same breath as this
    client), which is waited for with a line saying so."""
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
    if path is None:
        return
    started_s = time.monotonic()
    is_said = False
    while not os.path.exists(path):
        is_starting = _is_daemon_starting(path)
        if is_starting and not is_said:
            log.warning("cbatch: waiting for the daemon starting at %s", endpoint)
            is_said = True
        # A daemon started in the same breath may not even have taken its lock yet.
        if time.monotonic() - started_s > (STARTING_DAEMON_WAIT_S if is_starting else NO_LOCK_GRACE_S):
            raise unreachable(endpoint)
        time.sleep(STARTING_POLL_S)


def _request_body(prompt, messages, params) -> dict:
    body = dict(params)
    if prompt is not None:
        body["prompt"] = prompt
    if messages is not None:
        body["messages"] = messages
    return body


def choice_items(prompt, messages, params) -> Choices:
    """The batch item of a request with `n`: one request per choice, named by its index."""
    return Choices({**body, "id": i} for i, body in enumerate(expand_choices(_request_body(prompt, messages, params))))


def num_positions(items: list) -> int:
    """How many results a batch of these items has: one per choice of a Choices item."""
    return sum(len(item) if isinstance(item, Choices) else 1 for item in items)


def raise_any(results: list) -> list[Completion]:
    for result in results:
        if isinstance(result, CbatchError):
            raise result
    return results


@dataclass
class Embeddings:
    """What embeddings() returns: one vector per input, in order, as float32
    little-endian bytes (L2-normalized), and the tokens the inputs took."""

    data: list[bytes]
    prompt_tokens: int

    @property
    def vectors(self) -> list[list[float]]:
        return [vector_list(vector) for vector in self.data]


def embed_messages(inputs, dimensions: int | None, tenant: str | None = None) -> list[dict]:
    """The EMBED messages' fields for these inputs (checked here, so a bad input fails
    before anything is sent), MAX_INPUTS_PER_MESSAGE inputs a message. Each names its
    `part` of the call: the daemon counts the call as one request of its tenant (part 0)."""
    inputs = parse_inputs(inputs)
    extra = {} if parse_dimensions(dimensions) is None else {"dimensions": dimensions}
    if tenant is not None:
        extra["tenant"] = parse_scheduling({"tenant": tenant}).tenant
    return [{"input": inputs[at:at + MAX_INPUTS_PER_MESSAGE], "part": part, **extra}
            for part, at in enumerate(range(0, len(inputs), MAX_INPUTS_PER_MESSAGE))]


def joined_embeddings(replies: list[dict]) -> Embeddings:
    return Embeddings([vector for reply in replies for vector in reply["embeddings"]],
                      sum(reply["usage"]["prompt_tokens"] for reply in replies))


class ClientBase:
    """What both clients share: everything that does not wait. Subclasses set
    self._session and decide how to wait."""

    _session: Session

    @property
    def failure(self) -> CbatchError | None:
        """While the daemon is gone (it stopped answering, or taking messages), the error
        every request fails with at once; None while it answers."""
        return self._session.failure

    @property
    def info(self) -> dict:
        """The daemon's handshake: model, parallel, ctx_per_seq, use_ring, ring_name."""
        return dict(self._session.welcome)

    @property
    def tool_format(self) -> JsonAnswer | None:
        """The call format the model's own chat template teaches, when it knows tools (then
        the daemon renders a chat's tools and tool turns with it, and calls are read in this
        format); None for cbatch's own tool format, taught in words."""
        return format_of(self._session.welcome)

    def submit(self, prompt: str | None = None, messages: list | None = None, **params) -> RequestStream:
        """Send a request; read its chunks with read(stream)."""
        return self._session.submit(_request_body(prompt, messages, params))

    def _submit_whole(self, prompt: str | None, messages: list | None, params: dict) -> RequestStream:
        """A request whose completion alone is wanted (generate): its stream makes no chunks,
        and its records in the ring wake nobody until it ends."""
        return self._session.submit(_request_body(prompt, messages, params), keeps_chunks=False)

    def cancel(self, request_id: int) -> None:
        """End a request early: its stream ends with finish_reason "cancelled" and keeps
        the tokens produced so far."""
        self._session.cancel(request_id)

    def stream(self, prompt: str | None = None, messages: list | None = None, **params):
        """Chunks as tokens arrive (an iterator, or an async one); the last one has
        finish_reason and usage."""
        return self.read(self.submit(prompt, messages, **params))

    @contextlib.contextmanager
    def _reading(self, stream: RequestStream):
        """Around a caller's read of a stream: however it ends (done, an error, the caller
        leaving early), the stream is cancelled if still running and forgotten. After
        close() (an iterator outliving its client) there is no socket left to tell."""
        try:
            yield
        finally:
            if not self._session.is_closed:
                try:
                    if not stream.is_done:
                        self._session.cancel(stream.request_id)  # may raise: a send that timed out
                finally:
                    self._session.forget(stream)
