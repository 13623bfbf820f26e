"""cbatch.AsyncClient: the asyncio twin of cbatch.Client, over the same Session.

One pump task reads the socket and the ring for every coroutine sharing the client and
wakes only the waiters of the streams and replies that got something; waiting coroutines
never spin.

The socket is a plain pyzmq one, not zmq.asyncio's: the event loop watches its descriptor
and the ring's wake pipe with standing add_reader registrations, where an asyncio Poller
registered and removed both on every wake-up (a large share of an HTTP process's CPU
at many requests a second). libzmq's descriptor is edge-triggered: it says only that the
socket's state may have changed, and a send can consume the signal, so the pump reads
ZMQ_EVENTS after every wake-up and every send wakes it.
"""

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator

import zmq

from cbatch.client import session as session_module  # SEND_TIMEOUT_S read at each send: tests shorten it
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
from cbatch.client.session import CONNECTION, LIVENESS_S, SAFETY_POLL_S, Session
from cbatch.client.sockets import close_dealer, make_dealer
from cbatch.client.streams import BatchResults, Chunk, Completion, RequestStream
from cbatch.config import default_endpoint
from cbatch.errors import UNAVAILABLE, CbatchError
from cbatch.protocol import MsgType


class AsyncClient(ClientBase):
    """asyncio client: `client = await AsyncClient.connect()`; many coroutines may share it."""

    def __init__(self, endpoint: str | None = None, *, use_ring: bool = True,
                 curve_server_key: str | None = None, curve_client_key: str | None = None):
        self.endpoint = endpoint or default_endpoint()
        check_endpoint(self.endpoint)
        self._zctx = zmq.Context.instance()  # never terminated by us: see Client
        self._dealer = make_dealer(self._zctx, self.endpoint, curve_server_key, curve_client_key)
        # Messages the daemon did not take yet (its queue for this client is full), oldest
        # first, each with the monotonic time it fails at; the pump resends them in order.
        self._unsent: collections.deque[tuple[float, list[bytes]]] = collections.deque()
        self._is_kicked = True  # something may be ready: the pump looks before it sleeps
        self._wakeup: asyncio.Future | None = None  # what the sleeping pump awaits
        # The ring's wake pipe as registered with the pump's event loop (None: not registered)
        self._wake_fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the pump's
        self._session = Session(self._send, use_ring and self.endpoint.startswith("ipc://"),
                                on_arrival=self._on_arrival, before_ring_closes=self._unwatch_wake_fd)
        # What each waiting coroutine waits on (a stream, a reply's nonce, CONNECTION) -> its
        # futures: an arrival wakes those, and the hundreds of requests an HTTP server
        # waits on at once do not all wake whenever one of them gets a token.
        self._waiters: dict[object, set[asyncio.Future]] = {}
        self._failure: BaseException | None = None
        self._pump_task: asyncio.Task | None = None

    @property
    def is_broken(self) -> bool:
        """It cannot serve now: its pump stopped, or the daemon stopped answering or taking
        its messages. (The latter clears if the daemon speaks again.)"""
        return self.broken_reason is not None

    @property
    def broken_reason(self) -> str | None:
        if self._pump_task is not None and self._pump_task.done():
            return f"the client's pump stopped: {self._failure!r}"
        return None if self._session.failure is None else self._session.failure.message

    @classmethod
    async def connect(cls, endpoint: str | None = None, *, use_ring: bool = True,
                      connect_timeout_s: float = CONNECT_TIMEOUT_S, **curve_keys) -> "AsyncClient":
        client = cls(endpoint, use_ring=use_ring, **curve_keys)
        client._pump_task = asyncio.create_task(client._pump())
        try:
            client._session.hello()
            await asyncio.wait_for(client._wait(lambda: client._session.welcome is not None, [CONNECTION]),
                                   connect_timeout_s)
        except asyncio.TimeoutError:
            await client.close()
            raise unreachable(client.endpoint, is_silent=True) from None
        except BaseException:
            await client.close()
            raise
        return client

    async def _pump(self) -> None:
        loop, session = asyncio.get_running_loop(), self._session
        self._loop, dealer_fd = loop, self._dealer.getsockopt(zmq.FD)
        loop.add_reader(dealer_fd, self._kick)
        try:
            while True:
                # Attached to a ring, or to a restarted daemon's. A closed ring's pipe was
                # taken out already (before_ring_closes), so a new pipe that reuses its
                # number is registered too.
                if self._wake_fd != session.wake_fd:
                    self._unwatch_wake_fd(self._wake_fd)
                    if session.wake_fd is not None:
                        self._wake_fd = session.wake_fd
                        loop.add_reader(self._wake_fd, self._kick)
                if not self._is_kicked:
                    await self._sleep(loop, SAFETY_POLL_S if session.is_waiting else LIVENESS_S)
                self._is_kicked = False
                while self._dealer.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    session.on_frames(self._dealer.recv_multipart(zmq.NOBLOCK))
                if self._unsent:
                    num_unsent = len(self._unsent)
                    self._send_unsent(time.monotonic())
                    if len(self._unsent) < num_unsent:
                        self._kick()  # the sends may have consumed the descriptor's signal of an arrival
                session.read_ring()
                session.check_liveness(time.monotonic())
        except BaseException as exc:  # including CancelledError at close()
            self._failure = exc
            for key in list(self._waiters):
                self._on_arrival(key)
            raise
        finally:
            loop.remove_reader(dealer_fd)
            self._unwatch_wake_fd(self._wake_fd)

    def _unwatch_wake_fd(self, wake_fd: int | None) -> None:
        """The ring's wake pipe out of the event loop: before the session closes it (the
        session calls this), and when the pump moves to another ring or stops."""
        if wake_fd is not None and wake_fd == self._wake_fd:
            self._loop.remove_reader(wake_fd)
            self._wake_fd = None

    async def _sleep(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        """Until a registered descriptor is readable, a send was made, or timeout_s passed
        (sooner when an unsent message's time is up)."""
        if self._unsent:
            timeout_s = max(0.0, min(timeout_s, self._unsent[0][0] - time.monotonic()))
        self._wakeup = loop.create_future()
        timer = loop.call_later(timeout_s, self._kick)
        try:
            await self._wakeup
        finally:
            timer.cancel()
            self._wakeup = None

    def _kick(self) -> None:
        self._is_kicked = True
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def _send(self, frames: list[bytes]) -> None:
        """The session's send, never blocking: a message the daemon does not take now waits,
        in order, for the pump to resend it; one it has not taken within SEND_TIMEOUT_S
        fails the session, as the blocking client's send does. libzmq takes the rest of a
        multipart message once it took the first part."""
        if not self._unsent:
            try:
                self._dealer.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                self._unsent.append((time.monotonic() + session_module.SEND_TIMEOUT_S, frames))
        else:
            self._unsent.append((time.monotonic() + session_module.SEND_TIMEOUT_S, frames))
        self._kick()  # the send may have consumed the descriptor's signal of an arrival

    def _send_unsent(self, now_s: float) -> None:
        while self._unsent:
            fails_at_s, frames = self._unsent[0]
            try:
                self._dealer.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again as exc:
                if now_s >= fails_at_s:
                    # The messages behind it go too: the session fails every request and
                    # reply waiting on the daemon, which they were for.
                    self._unsent.clear()
                    if not self._session.is_closed:
                        self._session.on_send_failed(exc)
                return
            self._unsent.popleft()

    def _on_arrival(self, key) -> None:
        for waiter in self._waiters.get(key, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self, is_done, keys) -> None:
        """Until is_done() holds, sleep until something arrives for one of keys."""
        while not is_done():
            if self._session.failure is not None:
                raise self._session.failure
            if self._failure is not None:
                if isinstance(self._failure, CbatchError):
                    raise self._failure
                raise CbatchError(UNAVAILABLE, f"the client's connection stopped: {self._failure!r}")
            waiter = asyncio.get_running_loop().create_future()
            for key in keys:
                self._waiters.setdefault(key, set()).add(waiter)
            try:
                await waiter
            finally:
                for key in keys:
                    waiters = self._waiters[key]
                    waiters.discard(waiter)
                    if not waiters:
                        del self._waiters[key]

    async def read(self, stream: RequestStream) -> AsyncIterator[Chunk]:
        with self._reading(stream):
            while not stream.is_drained:
                await self._wait(lambda: stream.pending, [stream])
                chunk = stream.take()
                self._session.taken(stream)
                yield chunk

    async def generate(self, prompt: str | None = None, messages: list | None = None,
                       **params) -> Completion | list[Completion]:
        """A Completion; with `n`, a list of n Completions whose `id` is the choice index."""
        if "n" in params:
            return raise_any(await self.generate_batch([choice_items(prompt, messages, params)]))
        stream = self._submit_whole(prompt, messages, params)
        with self._reading(stream):
            await self._wait(lambda: stream.is_done, [stream])
        return stream.completion()

    async def stream_batch(self, items, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                           is_whole: bool = False) -> AsyncIterator[tuple[int, Chunk | CbatchError]]:
        """Yield (item position, chunk or error) as they arrive, at most max_in_flight
        requests outstanding. Each item's last chunk has finish_reason, or is an error.
        is_whole: as stream_batch_rounds'."""
        async with contextlib.aclosing(self.stream_batch_rounds(items, max_in_flight, is_whole)) as rounds:
            async for arrivals in rounds:
                for arrival in arrivals:
                    yield arrival

    async def stream_batch_rounds(self, items, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                                  is_whole: bool = False) -> AsyncIterator[list[tuple[int, Chunk | CbatchError]]]:
        """stream_batch's arrivals a round at a time: everything that arrived by one wake-up,
        for a server that writes each round to its callers at once. With is_whole (the caller
        wants each item whole) an item's rounds are its first chunk and the rest at its end."""
        feeder = BatchFeeder(self._session, items, max_in_flight, is_whole=is_whole)
        try:
            while True:
                errors = feeder.fill()
                if errors:
                    yield errors
                if feeder.is_done:
                    return
                await self._wait(feeder.has_arrivals, feeder.streams)
                yield feeder.take_arrivals()
        finally:
            feeder.close()

    async def generate_batch(self, items, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> list[Completion | CbatchError]:
        """Results in input order: a Completion, or the CbatchError that item got."""
        items = list(items)
        batch = BatchResults(num_positions(items))
        async for position, item in self.stream_batch(items, max_in_flight, is_whole=True):
            batch.add(position, item)
        return batch.results

    async def _ask(self, msg_type: MsgType, fields_list: list[dict] = ({},)) -> list[dict]:
        """One question per fields in fields_list, all sent at once; their replies in order."""
        nonces = [self._session.ask(msg_type, **fields) for fields in fields_list]
        try:
            await self._wait(lambda: all(self._session.replies[nonce] is not None for nonce in nonces), nonces)
            return [self._session.take_reply(nonce) for nonce in nonces]
        finally:  # a caller that gave up (a timeout, a cancel) leaves no entry to wait on, nor work
            self._session.forget_questions(msg_type, nonces)

    async def health(self) -> dict:
        return (await self._ask(MsgType.HEALTH))[0]

    async def stats(self) -> dict:
        return (await self._ask(MsgType.STATS))[0]

    async def embeddings(self, inputs, dimensions: int | None = None, tenant: str | None = None) -> Embeddings:
        """Embeddings of the inputs (strings or token-id lists) with the tokens they took,
        counted in `tenant`'s usage and limits (default: "default")."""
        return joined_embeddings(await self._ask(MsgType.EMBED, embed_messages(inputs, dimensions, tenant)))

    async def count_tokens(self, body: dict) -> int:
        """The tokens of a request body's prompt (a `prompt`, or `messages` rendered by the
        model's chat template), as the model would see it; nothing is generated."""
        return (await self._ask(MsgType.COUNT, [{"body": body}]))[0]["num_tokens"]

    async def embed(self, inputs, dimensions: int | None = None) -> list[list[float]]:
        """One L2-normalized vector per input (a string or a list of token ids), in order."""
        return (await self.embeddings(inputs, dimensions)).vectors

    async def close(self) -> None:
        if self._pump_task is not None:
            self._pump_task.cancel()
            try:
                await self._pump_task
            except BaseException:
                pass
        cancels = self._session.cancels_of_running()
        self._session.close()
        close_dealer(self._dealer, cancels)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        await self.close()
