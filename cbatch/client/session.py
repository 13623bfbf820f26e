"""The connection state both clients share: handshake, request streams, ring reading.

No waiting happens here. Client (blocking) and AsyncClient (asyncio) own the waiting and
feed this class what arrives: frames from the front-end, and ticks that say the ring has
new records.
"""

import contextlib
import secrets
import time

import zmq

from cbatch.errors import CbatchError, INTERNAL, INVALID_REQUEST, SHUTTING_DOWN, UNAVAILABLE
from cbatch.ipc.ring import RingError, RingOverrun, RingReader, attach_ring
from cbatch.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION, MsgType, ProtocolError, pack, unpack
from cbatch.client.streams import RequestStream

# A request that hears nothing for LIVENESS_S is named in a ping to the front-end, and a
# daemon that leaves MAX_MISSED_PINGS pings in a row unanswered is given up LIVENESS_S after
# the last: a client waiting on a dead daemon knows within LIVENESS_S * (MAX_MISSED_PINGS + 1)
# = 4.5 s, inside the 5 s promised. Two pings, not one, so that one answer held up by a busy
# moment does not fail every request; each has 1.5 s, ages for a front-end, which answers
# pings straight from its poll loop.
LIVENESS_S = 1.5
MAX_MISSED_PINGS = 2
SEND_TIMEOUT_S = 10.0  # a send the daemon does not take for this long (it cut this client off) fails
SAFETY_POLL_S = 0.1  # while waiting, read the ring (a tick may be dropped) and check liveness this often
MAX_PING_REQUEST_IDS = 4096  # stale requests named in one ping; the rest wait for the next
# What a driver's waiter for the handshake waits on (streams are waited on by themselves,
# replies by their nonce).
CONNECTION = "connection"


class Session:
    def __init__(self, send, use_ring: bool, clock=time.monotonic, on_arrival=None):
        self._send_frames = send  # callable(list[bytes]); the driver's socket send
        self._clock = clock  # seconds; the drivers' time.monotonic, a test's own
        # callable(key): something arrived for a RequestStream, a reply's nonce, or
        # CONNECTION; a driver that wakes waiters one by one wakes that key's.
        self._on_arrival = on_arrival or (lambda key: None)
        self.use_ring = use_ring
        self.welcome: dict | None = None
        self.streams: dict[int, RequestStream] = {}
        self.replies: dict[int, object] = {}  # nonce -> reply body or CbatchError
        self.reader: RingReader | None = None
        self._ring = None
        self._next_nonce = 0
        self.missed_pings = 0
        self.heard_s = clock()  # when the front-end last sent this client anything
        self._pinged_s = 0.0
        self._pinged_ids: dict[int, list[int]] = {}  # nonce of the last ping -> the request ids it named
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

    def submit(self, body: dict, label=None) -> RequestStream:
        if not isinstance(body, dict):
            raise CbatchError(INVALID_REQUEST, "a request must be a dict")
        if self.failure is not None:
            raise self.failure
        if self._clock() < self._refusing_until_s:
            raise CbatchError(SHUTTING_DOWN, "the daemon is shutting down and accepts no new requests")
        request_id = secrets.randbits(63) or 1  # unguessable by other clients
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
        # Log-probabilities come relayed with their records, never from the ring.
        wants_logprobs = body.get("logprobs") is not None
        stream = RequestStream(request_id, request_id if label is None else label, heard_s=self._clock(),
                               wants_logprobs=wants_logprobs)
        if self.reader is not None and not wants_logprobs:
            if not self.streams:
                self.reader = RingReader(self._ring)  # idle until now: start at the ring's present
            self.reader.watch(request_id)  # before the worker can publish anything for it
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

    def take_reply(self, nonce: int) -> dict:
        reply = self.replies.pop(nonce)
        if isinstance(reply, CbatchError):
            raise reply
        reply.pop("nonce", None)
        return reply

    def check_liveness(self, now_s: float) -> None:
        """Called by the driver after every round of waiting. Liveness is judged per
        request: one that heard nothing for LIVENESS_S is named in a ping, even while
        other requests' records flow, and the reply says whether the daemon still knows
        it. The daemon itself is given up after MAX_MISSED_PINGS unanswered pings: every
        waiting stream and reply then fails with `unavailable`."""
        if self.failure is not None or now_s - self._pinged_s < LIVENESS_S:
            return
        stale_ids = [request_id for request_id, stream in self.streams.items()
                     if not stream.is_done and now_s - stream.heard_s >= LIVENESS_S]
        is_reply_overdue = any(reply is None for reply in self.replies.values()) and now_s - self.heard_s >= LIVENESS_S
        if not stale_ids and not is_reply_overdue:
            return
        self.missed_pings += 1
        if self.missed_pings > MAX_MISSED_PINGS:
            self._fail_everything(CbatchError(UNAVAILABLE, "the cbatch daemon stopped answering; is cbatch-worker running?"))
            return
        self._pinged_s = now_s
        self._next_nonce += 1  # a ping's reply is not waited for; on_frames reads it
        stale_ids = stale_ids[:MAX_PING_REQUEST_IDS]
        self._pinged_ids = {self._next_nonce: stale_ids}  # an older ping's answer no longer matters
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

    def take(self, stream: RequestStream):
        """The stream's next chunk (the caller waited until it has one); raises its error."""
        item = stream.pending.popleft()
        if isinstance(item, CbatchError):
            raise item
        return item

    @contextlib.contextmanager
    def reading(self, stream: RequestStream):
        """Around a caller's read of a stream: however it ends, the stream is released."""
        try:
            yield
        finally:
            self.release(stream)

    def release(self, stream: RequestStream) -> None:
        """The caller is done with the stream: cancel it if it is still running. After
        close() (an iterator outliving its client) there is no socket left to tell."""
        if self.is_closed:
            return
        if not stream.is_done:
            self.cancel(stream.request_id)
        self.forget(stream)

    def forget(self, stream: RequestStream) -> None:
        self.streams.pop(stream.request_id, None)
        if self.reader is not None:
            self.reader.unwatch(stream.request_id)

    # ---- incoming ---------------------------------------------------------------
    def on_frames(self, frames: list[bytes]) -> None:
        self.missed_pings, self.heard_s, self.failure = 0, self._clock(), None
        try:
            msg_type, body = unpack(frames)
        except ProtocolError as err:
            raise CbatchError(INTERNAL, f"malformed message from the daemon: {err}") from None
        if msg_type is MsgType.WELCOME:
            self._on_welcome(body)
            self._on_arrival(CONNECTION)
        elif msg_type is MsgType.RECORDS:
            stream = self.streams.get(body["request_id"])
            if stream is not None:
                stream.add_records(body["records"], self.heard_s)
                self._on_arrival(stream)
                if self.reader is not None and not stream.wants_logprobs:
                    self.reader.resume(stream.request_id, stream.next_index)
                    self.read_ring()
        elif msg_type is MsgType.FINISHED:
            stream = self.streams.get(body["request_id"])
            if stream is not None:
                self.read_ring()  # the worker wrote every record before the finish was sent
                stream.on_finished(body, self.heard_s)
                self._on_arrival(stream)
                if stream.missing_records:
                    self.send(MsgType.FETCH, {"request_id": stream.request_id, "from_index": stream.next_index})
        elif msg_type is MsgType.ERROR:
            error = CbatchError(body.get("code", INTERNAL), body.get("message", ""))
            if error.code == SHUTTING_DOWN:
                self._refusing_until_s = self.heard_s + LIVENESS_S
            stream = self.streams.get(body.get("request_id"))
            if stream is not None:
                stream.fail(error)
                self._on_arrival(stream)
            elif body.get("nonce") in self.replies:
                self._set_reply(body["nonce"], error)
            elif self.welcome is None:
                raise error  # the handshake itself was refused
        elif msg_type in (MsgType.HEALTH_REPLY, MsgType.STATS_REPLY):
            lost_ids = set(body.get("lost_request_ids", ()))
            for request_id in self._pinged_ids.pop(body.get("nonce"), ()):
                stream = self.streams.get(request_id)
                if stream is None or stream.is_done:
                    continue
                if request_id in lost_ids:
                    stream.fail(CbatchError(UNAVAILABLE, "the daemon no longer knows this request (the connection "
                                                         "was lost or the daemon restarted); submit it again"))
                    self._on_arrival(stream)
                else:
                    stream.heard_s = self.heard_s  # the daemon answered for it: still in flight
            if body.get("nonce") in self.replies:
                self._set_reply(body["nonce"], body)

    def _on_welcome(self, body: dict) -> None:
        if body.get("use_ring") and self.reader is None:
            try:
                self._ring = attach_ring(body["ring_name"])
                self.reader = RingReader(self._ring)
            except RingError:
                # Not on the daemon's host (or no access): take the relayed stream instead.
                self.use_ring = False
                self.hello()
                return
        self.welcome = body

    def read_ring(self) -> None:
        if self.reader is None:
            return
        try:
            records = self.reader.poll()
        except RingOverrun as overrun:
            records = overrun.records
            for request_id in overrun.request_ids:
                stream = self.streams.get(request_id)
                if stream is not None:
                    self.send(MsgType.FETCH, {"request_id": request_id, "from_index": stream.next_index})
        except RingError as err:
            raise CbatchError(INTERNAL, f"the shared-memory token ring is corrupt ({err}); "
                                        "reconnect with use_ring=False / --no-shm") from None
        if records and self.read_latencies_ns is not None:
            self.read_latencies_ns.append(time.monotonic_ns() - self._ring.heartbeat_ns)
        now_s = self._clock()
        by_request: dict[int, list] = {}
        for r in records:
            by_request.setdefault(r.request_id, []).append((r.index, r.token_id, r.flags, r.finish, r.count, r.text))
        for request_id, rows in by_request.items():
            stream = self.streams.get(request_id)
            if stream is not None:
                stream.add_records(rows, now_s)
                self._on_arrival(stream)

    @property
    def is_waiting(self) -> bool:
        """A request or a reply is outstanding: its liveness is due every SAFETY_POLL_S,
        so a driver blocks no longer than that."""
        return bool(self.streams) or any(reply is None for reply in self.replies.values())

    @property
    def tick_endpoint(self) -> str | None:
        return self.welcome.get("tick_endpoint") if self.welcome and self.reader is not None else None

    def close(self) -> None:
        self.is_closed = True
        if self._ring is not None:
            self._ring.close()
            self._ring = None
            self.reader = None
