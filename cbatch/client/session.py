"""The connection state both clients share: handshake, request streams, ring reading.

No waiting happens here. Client (blocking) and AsyncClient (asyncio) own the waiting and
feed this class what arrives: frames from the front-end, and a wake-up on `wake_fd` when
the process's shared ring reader put records of this session's requests in its inbox.
"""

import secrets
import time

import zmq

from cbatch.client.liveness import LIVENESS_S, Liveness
from cbatch.client.shared_ring import RingTap
from cbatch.client.streams import Chunk, RequestStream
from cbatch.client.submit_frames import submit_frames
from cbatch.errors import INTERNAL, INVALID_REQUEST, SHUTTING_DOWN, UNAVAILABLE, CbatchError
from cbatch.ipc.ring import RingError
from cbatch.protocol import PROTOCOL_VERSION, MsgType, ProtocolError, pack, unpack
from cbatch.tools.chat import prepare_request

SEND_TIMEOUT_S = 10.0  # a send the daemon does not take for this long (it cut this client off) fails
SAFETY_POLL_S = 0.1  # while waiting, read the ring (a tick may be dropped) and check liveness this often
MAX_UNTAKEN_TOKENS = 4096  # of one request, held for a caller that has not taken them: past it, it is paused
# What a driver's waiter for the handshake waits on (streams are waited on by themselves,
# replies by their nonce).
CONNECTION = "connection"


class Session:
    def __init__(self, send, use_ring: bool, clock=time.monotonic, on_arrival=None, before_ring_closes=None):
        self._send_frames = send  # callable(list[bytes]); the driver's socket send
        self._clock = clock  # seconds; the drivers' time.monotonic, a test's own
        # callable(key): something arrived for a RequestStream, a reply's nonce, or
        # CONNECTION; a driver that wakes waiters one by one wakes that key's.
        self._on_arrival = on_arrival or (lambda key: None)
        # callable(wake_fd): the ring's wake pipe is about to be closed; a driver that keeps
        # it registered with an event loop takes it out first.
        self._before_ring_closes = before_ring_closes or (lambda wake_fd: None)
        self.use_ring = use_ring
        self._wants_ring = use_ring  # as asked, whatever a daemon offered since
        self.welcome: dict | None = None
        self.streams: dict[int, RequestStream] = {}
        self.replies: dict[int, object] = {}  # nonce -> reply body or CbatchError
        self._ring: RingTap | None = None  # None while the tokens come relayed over ZeroMQ
        self._next_nonce = 0
        self.liveness = Liveness(clock())
        # Set when the daemon stopped answering or taking messages: every stream and reply
        # got it, and new submits fail with it at once; cleared when the daemon speaks again.
        self.failure: CbatchError | None = None
        # A draining daemon refuses every submit: for a moment after it said so, refuse
        # here, so a batch ends each of its remaining items at once instead of one by one.
        self._refusing_until_s = 0.0
        self.is_closed = False
        # When a list: for every ring poll that returned records, nanoseconds from the
        # writer's publish (the ring's heartbeat stamp) to this read. For benchmarks.
        self.read_latencies_ns: list[int] | None = None

    # ---- outgoing ---------------------------------------------------------------
    def send(self, msg_type: MsgType, body: dict) -> None:
        self._send(pack(msg_type, body))

    def _send(self, frames: list[bytes]) -> None:
        try:
            self._send_frames(frames)
        except zmq.Again as exc:
            raise self.on_send_failed(exc) from None

    def on_send_failed(self, exc: Exception) -> CbatchError:
        """A send that failed: the daemon did not take it within SEND_TIMEOUT_S (zmq.Again:
        it cut this client off, or it is gone), or the socket broke. Nothing waiting here will
        be answered, so every waiting stream and reply fails; returns the error for the
        sender to raise."""
        if isinstance(exc, zmq.Again):
            reason = f"the daemon took no message from this client for {SEND_TIMEOUT_S:g} s " \
                     "(it stopped reading it, or it is gone)"
        else:
            reason = f"a message to the daemon could not be sent ({exc})"
        error = CbatchError(UNAVAILABLE, f"{reason}; is cbatch-worker running?")
        self._fail_everything(error)
        return error

    def hello(self) -> None:
        self.send(MsgType.HELLO, {"version": PROTOCOL_VERSION, "use_ring": self.use_ring})

    def submit(self, body: dict, label=None, keeps_chunks: bool = True) -> RequestStream:
        if not isinstance(body, dict):
            raise CbatchError(INVALID_REQUEST, "a request must be a dict")
        if self.failure is not None:
            raise self.failure
        if self._clock() < self._refusing_until_s:
            raise CbatchError(SHUTTING_DOWN, "the daemon is shutting down and accepts no new requests")
        body, tool_plan = prepare_request(body, self.welcome)  # tools: the plan that reads calls back
        request_id = secrets.randbits(63) or 1  # unguessable by other clients
        frames = submit_frames(request_id, body)
        # Log-probabilities come relayed with their records, never from the ring.
        wants_logprobs = body.get("logprobs") is not None
        stream = RequestStream(request_id, request_id if label is None else label, heard_s=self._clock(),
                               wants_logprobs=wants_logprobs, tool_plan=tool_plan, keeps_chunks=keeps_chunks)
        if self._ring is not None and not wants_logprobs:
            self._ring.watch(request_id, is_muted=not keeps_chunks)  # before the worker can publish for it
        self.streams[request_id] = stream
        try:
            self._send(frames)
        except CbatchError:
            self.forget(stream)
            raise
        return stream

    def cancel(self, request_id: int) -> None:
        self.send(MsgType.CANCEL, {"request_id": request_id})

    def ask(self, msg_type: MsgType, **fields) -> int:
        """Send a question; its reply (or error) lands in replies[nonce]."""
        self._next_nonce += 1
        self.replies[self._next_nonce] = None
        self.send(msg_type, {"nonce": self._next_nonce, **fields})
        return self._next_nonce

    def _pause_if_behind(self, stream: RequestStream) -> None:
        """Back-pressure: past MAX_UNTAKEN_TOKENS of a request that its caller has not taken
        (an HTTP server whose caller reads slowly, a loop that sleeps between chunks), the
        daemon pauses it, until the caller takes them (taken())."""
        # A stream wanted whole wakes its reader only at its end: pausing it would never end.
        if (not stream.is_paused and not stream.is_done and not stream.is_whole
                and stream.num_pending_tokens > MAX_UNTAKEN_TOKENS):
            stream.is_paused = True
            self.send(MsgType.PAUSE, {"request_id": stream.request_id, "is_paused": True})

    def taken(self, stream: RequestStream) -> None:
        """The caller took what was pending of the stream: a paused request goes on."""
        if any(isinstance(item, Chunk) for item in stream.pending):
            return
        stream.num_pending_tokens = 0
        if stream.is_paused:
            stream.is_paused = False
            if not stream.is_done:
                self.send(MsgType.PAUSE, {"request_id": stream.request_id, "is_paused": False})

    def forget_questions(self, msg_type: MsgType, nonces: list[int]) -> None:
        """The caller no longer waits for these: an EMBED still unanswered is cancelled, so
        the daemon does not compute what nobody reads."""
        for nonce in nonces:
            if self.replies.pop(nonce, False) is None and msg_type is MsgType.EMBED and self.failure is None:
                try:
                    self.send(MsgType.EMBED_CANCEL, {"nonce": nonce})
                except CbatchError:  # the daemon is gone: nothing runs there to cancel
                    pass

    def take_reply(self, nonce: int) -> dict:
        reply = self.replies.pop(nonce)
        if isinstance(reply, CbatchError):
            raise reply
        reply.pop("nonce", None)
        return reply

    def check_liveness(self, now_s: float) -> None:
        """Called by the driver after every round of waiting: pings the daemon about quiet
        requests (the reply says whether it still knows them), and gives it up after
        MAX_MISSED_PINGS unanswered pings: every waiting stream and reply then fails
        with `unavailable`."""
        if self.failure is not None:
            return
        stale_ids = self.liveness.due_ping(now_s, self.streams, self.replies)
        if stale_ids is None:
            return
        if self.liveness.is_given_up:
            self._fail_everything(CbatchError(UNAVAILABLE,
                                              "the cbatch daemon stopped answering; is cbatch-worker running?"))
            return
        self._next_nonce += 1  # a ping's reply is not waited for; on_frames reads it
        self.liveness.on_ping_sent(self._next_nonce, stale_ids)
        self.send(MsgType.HEALTH, {"nonce": self._next_nonce, "request_ids": stale_ids})

    def _fail_everything(self, error: CbatchError) -> None:
        self.failure = error
        for stream in self.streams.values():
            if not stream.is_done:
                stream.fail(error)
                self._on_arrival(stream)
        for nonce, reply in self.replies.items():
            if reply is None:
                self._set_reply(nonce, error)

    def _set_reply(self, nonce: int, reply) -> None:
        self.replies[nonce] = reply
        self._on_arrival(nonce)

    def forget(self, stream: RequestStream) -> None:
        self.streams.pop(stream.request_id, None)
        if self._ring is not None:
            self._ring.unwatch(stream.request_id)

    # ---- incoming ---------------------------------------------------------------
    def on_frames(self, frames: list[bytes]) -> None:
        self.liveness.on_heard(self._clock())
        self.failure = None
        try:
            msg_type, body = unpack(frames)
        except ProtocolError as err:
            raise CbatchError(INTERNAL, f"malformed message from the daemon: {err}") from None
        handler = self._handlers.get(msg_type)
        if handler is not None:
            handler(self, body)

    def _on_welcome(self, body: dict) -> None:
        """Also a WELCOME nobody asked for: the daemon restarted on this endpoint (it relays this
        client until it says HELLO again) or recreated its ring; the old ring is given up."""
        is_another_ring = self.welcome is not None and body.get("ring_name") != self.welcome.get("ring_name")
        if is_another_ring and self._ring is not None:
            self._close_ring()
            self.use_ring = self._wants_ring
        if body.get("use_ring") and self._ring is None:
            try:
                self._ring = RingTap(body["ring_name"], body["tick_endpoint"],
                                     self.streams.values() if is_another_ring else ())
            except RingError:
                # Not on the daemon's host (or no access): take the relayed stream instead.
                self.use_ring = False
                self.hello()
                return
        self.welcome = body
        self._on_arrival(CONNECTION)
        if is_another_ring and self.use_ring and not body.get("use_ring"):
            self.hello()  # for this daemon's ring

    def _on_records(self, body: dict) -> None:
        stream = self.streams.get(body["request_id"])
        if stream is None:
            return
        stream.add_records(body["records"], self.liveness.heard_s)
        self._pause_if_behind(stream)
        if stream.is_wake_due():
            self._on_arrival(stream)
        if self._ring is not None and not stream.wants_logprobs:
            self._ring.recovered(stream.request_id, stream.next_index)
            self.read_ring()

    def _on_finished(self, body: dict) -> None:
        stream = self.streams.get(body["request_id"])
        if stream is None:
            return
        self.read_ring(is_pumped=True)  # the worker wrote every record before the finish was sent
        stream.on_finished(body, self.liveness.heard_s)
        self._on_arrival(stream)
        if stream.missing_records:
            self.send(MsgType.FETCH, {"request_id": stream.request_id, "from_index": stream.next_index})

    def _on_error(self, body: dict) -> None:
        error = CbatchError(body.get("code", INTERNAL), body.get("message", ""), body.get("retry_after_s"))
        if error.code == SHUTTING_DOWN:
            self._refusing_until_s = self.liveness.heard_s + LIVENESS_S
        stream = self.streams.get(body.get("request_id"))
        if stream is not None:
            stream.fail(error)
            self._on_arrival(stream)
        elif body.get("nonce") in self.replies:
            self._set_reply(body["nonce"], error)
        elif self.welcome is None:
            raise error  # the handshake itself was refused

    def _on_health(self, body: dict) -> None:
        """A HEALTH, STATS, EMBED or COUNT reply: also the answer to a liveness ping, if it named requests."""
        lost_ids = set(body.get("lost_request_ids", ()))
        for request_id in self.liveness.take_pinged_ids(body.get("nonce")):
            stream = self.streams.get(request_id)
            if stream is None or stream.is_done:
                continue
            if request_id in lost_ids:
                stream.fail(CbatchError(UNAVAILABLE, "the daemon no longer knows this request (the connection "
                                                     "was lost or the daemon restarted); submit it again"))
                self._on_arrival(stream)
            else:
                stream.heard_s = self.liveness.heard_s  # the daemon answered for it: still in flight
        if body.get("nonce") in self.replies:
            self._set_reply(body["nonce"], body)

    _handlers = {MsgType.WELCOME: _on_welcome, MsgType.RECORDS: _on_records, MsgType.FINISHED: _on_finished,
                 MsgType.ERROR: _on_error, MsgType.HEALTH_REPLY: _on_health, MsgType.STATS_REPLY: _on_health,
                 MsgType.EMBED_REPLY: _on_health, MsgType.COUNT_REPLY: _on_health}

    def read_ring(self, is_pumped: bool = False) -> None:
        """Take what the process's ring reader put for this session; with is_pumped,
        read the ring first, on this thread."""
        if self._ring is None:
            return
        rows_by_request, gapped_ids, error = self._ring.take(is_pumped)
        if error is not None:
            raise CbatchError(INTERNAL, f"the shared-memory token ring is corrupt ({error}); "
                                        "reconnect with use_ring=False / --no-shm")
        for request_id in gapped_ids:  # overrun: what the ring lost comes over ZeroMQ
            stream = self.streams.get(request_id)
            if stream is not None:
                self.send(MsgType.FETCH, {"request_id": request_id, "from_index": stream.next_index})
        if rows_by_request and self.read_latencies_ns is not None:
            self.read_latencies_ns.append(time.monotonic_ns() - self._ring.heartbeat_ns)
        now_s = self._clock()
        for request_id, rows in rows_by_request.items():
            stream = self.streams.get(request_id)
            if stream is not None:
                stream.add_records(rows, now_s)
                self._pause_if_behind(stream)
                if stream.is_wake_due():
                    self._on_arrival(stream)

    @property
    def is_waiting(self) -> bool:
        """A request or a reply is outstanding: its liveness is due every SAFETY_POLL_S,
        so a driver blocks no longer than that."""
        return bool(self.streams) or any(reply is None for reply in self.replies.values())

    @property
    def wake_fd(self) -> int | None:
        """Readable when the ring reader has records for this session: what a driver polls
        beside its socket. None while tokens come relayed."""
        return None if self._ring is None else self._ring.wake_fd

    def cancels_of_running(self) -> list[list[bytes]]:
        """CANCEL messages for the requests still running, for a client that closes: over tcp
        the daemon cannot tell a closed client from a paused one, and would otherwise keep
        generating for them through its reconnect grace."""
        if self.welcome is None or self.failure is not None:
            return []
        return [pack(MsgType.CANCEL, {"request_id": request_id})
                for request_id, stream in self.streams.items() if not stream.is_done]

    def close(self) -> None:
        self.is_closed = True
        if self._ring is not None:
            self._close_ring()

    def _close_ring(self) -> None:
        self._before_ring_closes(self._ring.wake_fd)
        self._ring.close()
        self._ring = None
