"""cbatch.Client, the blocking client; cbatch.AsyncClient (asyncio) is its twin.

A client on the daemon's host reads its tokens straight from the shared-memory ring,
through the one ring reader its process shares (it wakes this client only when one of
its requests has records); elsewhere (or with use_ring=False) the front-end relays
the same records over ZeroMQ. Both look the same to the caller.

One Client per thread (ZeroMQ sockets are not thread-safe); one AsyncClient per event loop.
"""

import time
from collections.abc import Callable, Iterator

import zmq

from cbatch.client.base import (
    CONNECT_TIMEOUT_S,
    ClientBase,
    Embeddings,
    check_endpoint,
    choice_items,
    embed_messages,
    joined_embeddings,
    num_positions,
    raise_any,
    unreachable,
)
from cbatch.client.batch_feeder import DEFAULT_MAX_IN_FLIGHT, BatchFeeder
from cbatch.client.batch_retry import Patience
from cbatch.client.session import SAFETY_POLL_S, Session
from cbatch.client.sockets import close_dealer, make_dealer
from cbatch.client.streams import BatchResults, Chunk, Completion, RequestStream
from cbatch.config import default_endpoint
from cbatch.errors import CbatchError
from cbatch.protocol import MsgType


class Client(ClientBase):
    def __init__(self, endpoint: str | None = None, *, use_ring: bool = True,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 curve_server_key: str | None = None, curve_client_key: str | None = None):
        self.endpoint = endpoint or default_endpoint()
        check_endpoint(self.endpoint)
        # The process-wide context, never terminated by us: a Client that is garbage
        # collected unclosed (say, in a reference cycle) must not make the collector block
        # in zmq_ctx_term waiting for sockets the same collection already dropped.
        self._zctx = zmq.Context.instance()
        self._dealer = make_dealer(self._zctx, self.endpoint, curve_server_key, curve_client_key)
        self._session = Session(self._dealer.send_multipart, use_ring and self.endpoint.startswith("ipc://"))
        self._poller = zmq.Poller()
        self._poller.register(self._dealer, zmq.POLLIN)
        self._wake_fd: int | None = None  # the session's, as registered with the poller
        try:
            self._session.hello()
            self._wait(lambda: self._session.welcome is not None, time.monotonic() + connect_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait(self, is_done, deadline: float | None = None, is_failure_raised: bool = True) -> None:
        """Pump messages and ring records until is_done() holds. A daemon given up is raised,
        unless is_failure_raised is false (a batch holding its requests waits for one that
        comes back, whose first message clears the failure)."""
        session = self._session
        while not is_done():
            if session.failure is not None and is_failure_raised:
                raise session.failure
            if deadline is not None and time.monotonic() > deadline:
                raise unreachable(self.endpoint, is_silent=True)
            if self._wake_fd != session.wake_fd:  # attached to a ring, or to a restarted daemon's
                if self._wake_fd is not None:
                    self._poller.unregister(self._wake_fd)
                self._wake_fd = session.wake_fd
                if self._wake_fd is not None:
                    self._poller.register(self._wake_fd, zmq.POLLIN)
            ready = dict(self._poller.poll(int(SAFETY_POLL_S * 1000)))  # waiting: liveness is due that often
            if self._dealer in ready:
                while self._dealer.poll(0):
                    session.on_frames(self._dealer.recv_multipart())
            session.read_ring()
            session.check_liveness(time.monotonic())

    def read(self, stream: RequestStream) -> Iterator[Chunk]:
        """Chunks of a submitted request; leaving early cancels it."""
        with self._reading(stream):
            while not stream.is_drained:
                self._wait(lambda: stream.pending)
                chunk = stream.take()
                self._session.taken(stream)
                yield chunk

    def generate(self, prompt: str | None = None, messages: list | None = None,
                 **params) -> Completion | list[Completion]:
        """A Completion; with `n`, a list of n Completions whose `id` is the choice index."""
        if "n" in params:
            return raise_any(self.generate_batch([choice_items(prompt, messages, params)]))
        stream = self._submit_whole(prompt, messages, params)
        with self._reading(stream):
            self._wait(lambda: stream.is_done)
        return stream.completion()

    def stream_batch(self, items, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, patience: Patience | None = None,
                     should_stop: Callable[[], bool] | None = None) -> Iterator[tuple[int, Chunk | CbatchError]]:
        """Run items with at most max_in_flight outstanding; yield (item position, chunk or
        error) as they arrive. Each item's last chunk has finish_reason, or is an error.
        With a patience, items refused for a moment are held and sent again (BatchFeeder).
        Once should_stop() holds (asked between arrivals, at least every SAFETY_POLL_S) the
        iteration ends early and the outstanding requests are cancelled."""
        feeder = BatchFeeder(self._session, items, max_in_flight, patience)
        is_stopped = should_stop or (lambda: False)
        try:
            while not is_stopped():
                yield from feeder.fill()
                if feeder.is_done:
                    return
                self._wait(lambda: feeder.has_arrivals() or is_stopped(), is_failure_raised=patience is None)
                yield from feeder.take_arrivals()
        finally:
            feeder.close()

    def generate_batch(self, items, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> list[Completion | CbatchError]:
        """Results in input order: a Completion, or the CbatchError that item got."""
        items = list(items)
        batch = BatchResults(num_positions(items))
        for position, item in self.stream_batch(items, max_in_flight):
            batch.add(position, item)
        return batch.results

    def _ask(self, msg_type: MsgType, fields_list: list[dict] = ({},)) -> list[dict]:
        """One question per fields in fields_list, all sent at once; their replies in order."""
        nonces = [self._session.ask(msg_type, **fields) for fields in fields_list]
        try:
            self._wait(lambda: all(self._session.replies[nonce] is not None for nonce in nonces))
            return [self._session.take_reply(nonce) for nonce in nonces]
        finally:  # a caller that gave up (an error, Ctrl-C) leaves no entry to wait on, nor work
            self._session.forget_questions(msg_type, nonces)

    def pause(self, seconds: float) -> None:
        """Wait `seconds`, taking what arrives meanwhile, even from a daemon this client gave
        up: its first message makes the client usable again (a caller retrying after a
        restart pauses so between tries)."""
        until_s = time.monotonic() + seconds
        self._wait(lambda: time.monotonic() >= until_s, is_failure_raised=False)

    def health(self) -> dict:
        return self._ask(MsgType.HEALTH)[0]

    def stats(self) -> dict:
        return self._ask(MsgType.STATS)[0]

    def count_tokens(self, body: dict) -> int:
        """The tokens of a request body's prompt (a `prompt`, or `messages` rendered by the
        model's chat template), as the model would see it; nothing is generated."""
        return self._ask(MsgType.COUNT, [{"body": body}])[0]["num_tokens"]

    def embeddings(self, inputs, dimensions: int | None = None, tenant: str | None = None) -> Embeddings:
        """Embeddings of the inputs (strings or token-id lists) with the tokens they took,
        counted in `tenant`'s usage and limits (default: "default")."""
        return joined_embeddings(self._ask(MsgType.EMBED, embed_messages(inputs, dimensions, tenant)))

    def embed(self, inputs, dimensions: int | None = None) -> list[list[float]]:
        """One L2-normalized vector per input (a string or a list of token ids), in order."""
        return self.embeddings(inputs, dimensions).vectors

    def close(self) -> None:
        cancels = self._session.cancels_of_running()
        self._session.close()
        close_dealer(self._dealer, cancels)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

