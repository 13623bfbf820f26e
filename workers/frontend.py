"""The front-end: the one socket clients talk to. It never touches the model.

It validates every message, owns the bounded set of in-flight requests and which client
owns each, forwards submits and cancels to the decode worker, and relays the worker's
events: the finish (with usage and the record count) to every owner, and the records
themselves to clients that do not read the ring. It keeps each request's records until
a while after it finishes, so a reader that the ring lapped can fetch what it missed.
"""

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field as dc_field

import msgpack
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from cbatch.config import DaemonConfig
from cbatch.errors import CbatchError, INTERNAL, INVALID_CONFIG, INVALID_REQUEST, NOT_FOUND, QUEUE_FULL, SHUTTING_DOWN, VERSION_MISMATCH
from cbatch.ipc.ring import FINISH_CODES, RingRecord, event_records
from cbatch.params import parse_request
from cbatch.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION, MsgType, ProtocolError, field, pack, unpack

log = logging.getLogger("cbatch.worker")

MAX_REQUEST_ID = (1 << 63) - 1
CLOSE_LINGER_MS = 500
MAX_MESSAGES_PER_TURN = 256
MAX_RECORDS_PER_MESSAGE = 4096  # RECORDS replies are split to stay far inside the unpack limits
PEER_HEARTBEAT_MS = 1000
CLOSED_MEMORY_S = 10.0  # how long messages still queued from a closed connection are recognised


@dataclass(eq=False)
class Job:
    request_id: int
    owner: bytes  # the client's ROUTER identity
    is_relayed: bool  # the owner reads records over ZeroMQ instead of the ring
    body: dict | None = None  # the request, kept only until it reaches a ready worker
    finish: dict | None = None  # the FINISHED body, once finished (resent on request)
    is_finish_delivered: bool = False
    records: list[RingRecord] = dc_field(default_factory=list)
    finished_at: float | None = None


class FrontEnd:
    def __init__(self, zctx: zmq.Context, config: DaemonConfig, ring_name: str, tick_endpoint: str,
                 control_endpoint: str):
        self.config = config
        self._ring_name, self._tick_endpoint = ring_name, tick_endpoint
        self.clients = zctx.socket(zmq.ROUTER)
        self.clients.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)  # the last errors still reach clients
        self.clients.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client raises instead of queueing
        self.clients.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client reconnecting under its id takes it over
        # Over tcp a peer can vanish without closing: libzmq's own PING/PONG notices it.
        self.clients.setsockopt(zmq.HEARTBEAT_IVL, PEER_HEARTBEAT_MS)
        self.clients.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * PEER_HEARTBEAT_MS)
        # A frame bigger than any valid message drops the connection before it is buffered.
        self.clients.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
        # No receive high-water mark. At the mark libzmq stops reading that connection, and
        # if the peer dies while it is stopped, resuming the read aborts the whole process
        # (libzmq 4.3's "!_io_error" assertion): a client that floods submits and is then
        # killed took the daemon down. The front-end reads faster than a client can write
        # (each message costs it one validation), so the kernel's socket buffer bounds
        # what waits.
        self.clients.setsockopt(zmq.RCVHWM, 0)
        self.control = zctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        # Never drop a submit or cancel on its way to the worker: no high-water mark here
        # (the in-flight count is bounded by --parallel + --max-queue instead).
        self.control.setsockopt(zmq.SNDHWM, 0)
        self.control.setsockopt(zmq.RCVHWM, 0)
        self._authenticator = None
        try:
            if config.curve_secret_key:
                self._authenticator = self._require_curve(zctx)
            self.clients.bind(config.endpoint)
            self.control.bind(control_endpoint)
        except Exception:
            if self._authenticator is not None:
                self._authenticator.stop()
            raise
        # Dead clients: a disconnect event names the connection's file descriptor, and every
        # message says which descriptor it came on; a crashed or killed client's requests
        # are cancelled as soon as the kernel closes its socket.
        self.disconnects = self.clients.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._peer_by_fd: dict[int, bytes] = {}
        # identity -> (descriptor, monotonic time) of connections that closed: what they
        # sent before closing may still be queued, and must not start work nobody reads.
        self._closed: dict[bytes, tuple[int, float]] = {}
        self.jobs: dict[int, Job] = {}
        self._finished: OrderedDict[int, Job] = OrderedDict()
        self._use_ring: dict[bytes, bool] = {}
        self._stalled: set[bytes] = set()  # clients whose queue filled up; see _stall
        self._undelivered: dict[bytes, dict[int, Job]] = {}  # owner -> finished requests whose finish it lacks
        self._newly_stalled: set[bytes] = set()
        self.worker: dict | None = None  # the READY body of the live worker; None while (re)starting
        self.worker_identity: bytes | None = None  # the routing id of the worker started last
        self.worker_failure: str | None = None
        self.worker_failure_code: str | None = None  # INVALID_CONFIG: a setting is wrong, retrying cannot help
        self.worker_stats: dict = {}
        self.is_draining = False
        self.requests_completed = 0
        self.num_fetches = 0  # FETCHes answered: each one is a reader the ring lapped (or a lost record)

    def _require_curve(self, zctx: zmq.Context) -> ThreadAuthenticator:
        """Encrypt and authenticate the client socket with CurveZMQ: the daemon's keys from
        its certificate file; clients admitted by public key (a directory of certificates)
        or, without one, any client that knows the daemon's public key."""
        public_key, secret_key = zmq.auth.load_certificate(self.config.curve_secret_key)
        if not secret_key:
            raise CbatchError(INVALID_CONFIG, f"{self.config.curve_secret_key} holds no secret key")
        authenticator = ThreadAuthenticator(zctx)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=self.config.curve_clients_dir or zmq.auth.CURVE_ALLOW_ANY)
        self.clients.curve_server = True
        self.clients.curve_publickey, self.clients.curve_secretkey = public_key, secret_key
        return authenticator

    # ---- clients ----------------------------------------------------------------
    def on_client_messages(self) -> None:
        for _ in range(MAX_MESSAGES_PER_TURN):  # then let the worker's events through too
            self.on_disconnects()  # first: a closed descriptor may be reused by the next message
            if not self.clients.poll(0):
                break
            identity_frame, *message = self.clients.recv_multipart(copy=False)
            identity, frames = identity_frame.bytes, [frame.bytes for frame in message]
            if message:
                fd = int(message[0].get("__fd"))
                closed = self._closed.get(identity)
                if closed is not None:
                    if closed[0] == fd:
                        continue  # sent just before its connection closed
                    del self._closed[identity]  # the same client, reconnected
                self._peer_by_fd[fd] = identity
            if identity in self._stalled:
                self._unstall(identity)
            body: dict = {}
            try:
                msg_type, body = unpack(frames)
                handler = self._CLIENT_HANDLERS.get(msg_type)
                if handler is None:
                    raise ProtocolError(f"message type {msg_type.name} is not sent by clients")
                handler(self, identity, body)
            except ProtocolError as err:
                self._error(identity, INVALID_REQUEST, str(err), body)
            except CbatchError as err:
                self._error(identity, err.code, err.message, body)
            except Exception as err:  # a bug must cost one reply, not the daemon
                log.exception("front-end failed on a client message")
                self._error(identity, INTERNAL, f"the front-end failed on this message: {type(err).__name__}", body)
        self._apply_stalls()

    def on_disconnects(self) -> None:
        """The client went away (closed, crashed, killed): nobody will read its requests."""
        while self.disconnects.poll(0):
            fd = int(recv_monitor_message(self.disconnects)["value"])
            identity = self._peer_by_fd.pop(fd, None)
            if identity is not None:
                now = time.monotonic()
                self._closed = {i: c for i, c in self._closed.items() if now - c[1] < CLOSED_MEMORY_S}
                self._closed[identity] = (fd, now)
                self._on_disconnect(identity)

    def _on_disconnect(self, identity: bytes) -> None:
        self._use_ring.pop(identity, None)
        self._stalled.discard(identity)
        for job in list(self.jobs.values()):
            if job.owner == identity:
                self._cancel_job(job)

    def _send(self, identity: bytes, msg_type: MsgType, body: dict) -> bool:
        """Send without ever blocking the loop; False if the message was dropped."""
        try:
            self.clients.send_multipart([identity, *pack(msg_type, body)], zmq.NOBLOCK)
            return True
        except zmq.Again:  # the client's queue is full: it stopped reading
            self._stall(identity)
        except zmq.ZMQError:
            pass  # the client is gone; the disconnect event cancels its requests
        return False

    def _stall(self, identity: bytes) -> None:
        """A client that lets ZeroMQ's queue to it fill up (its high-water mark) stops
        costing the others: its requests are cancelled (by _apply_stalls, once the message
        being handled is done). What it missed stays fetchable."""
        if identity not in self._stalled:
            self._stalled.add(identity)
            self._newly_stalled.add(identity)

    def _apply_stalls(self) -> None:
        while self._newly_stalled:
            identity = self._newly_stalled.pop()
            for job in list(self.jobs.values()):
                if job.owner == identity:
                    self._cancel_job(job)

    def _unstall(self, identity: bytes) -> None:
        """The stalled client speaks again: resend the finishes it may have lost, so it
        can fetch any records it lacks and end those streams."""
        self._stalled.discard(identity)
        for job in list(self._undelivered.get(identity, {}).values()):
            self._deliver_finish(job)
            if not job.is_finish_delivered:
                break  # its queue is full again: the rest waits for its next message

    def _deliver_finish(self, job: Job) -> None:
        """Send a request's finish to its owner; one that cannot be sent is owed to it.
        Only what a client is owed is ever re-sent, so a flooding client that stalls costs
        the loop one failed send per message, not a pass over every finished request."""
        job.is_finish_delivered = self._send(job.owner, MsgType.FINISHED, job.finish)
        owed = self._undelivered.setdefault(job.owner, {})
        if job.is_finish_delivered:
            owed.pop(job.request_id, None)
        else:
            owed[job.request_id] = job
        if not owed:
            del self._undelivered[job.owner]

    def _error(self, identity: bytes, code: str, message: str, body: dict) -> None:
        reply = {"code": code, "message": message}
        for key in ("request_id", "nonce"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                reply[key] = body[key]
        self._send(identity, MsgType.ERROR, reply)

    def _hello(self, identity: bytes, body: dict) -> None:
        version = field(body, "version", int)
        if version != PROTOCOL_VERSION:
            raise CbatchError(VERSION_MISMATCH, f"client speaks protocol {version}, this daemon {PROTOCOL_VERSION}; upgrade cbatch")
        use_ring = bool(field(body, "use_ring", bool)) and self.config.endpoint.startswith("ipc://")
        self._use_ring[identity] = use_ring
        worker = self.worker or {}
        self._send(identity, MsgType.WELCOME, {
            "version": PROTOCOL_VERSION, "model": worker.get("model", ""), "parallel": self.config.engine.parallel,
            "ctx_per_seq": worker.get("ctx_per_seq", 0), "use_ring": use_ring,
            "ring_name": self._ring_name if use_ring else "", "tick_endpoint": self._tick_endpoint if use_ring else "",
        })

    def _submit(self, identity: bytes, body: dict) -> None:
        request_id = field(body, "request_id", int)
        if not 1 <= request_id <= MAX_REQUEST_ID:
            raise ProtocolError("request_id must be in [1, 2**63 - 1]")
        if request_id in self.jobs or request_id in self._finished:
            raise CbatchError(INVALID_REQUEST, f"request_id {request_id} is already in use")
        request_body = field(body, "body", dict)
        parse_request(request_id, request_body)  # reject bad input here, before it costs the worker anything
        if len(msgpack.packb(request_body)) > MAX_FRAME_BYTES - 1024:  # floats re-encode wider
            raise CbatchError(INVALID_REQUEST, "the request is too large to forward")
        if self.is_draining:
            raise CbatchError(SHUTTING_DOWN, "the daemon is shutting down and accepts no new requests")
        max_in_flight = self.config.engine.parallel + self.config.engine.max_queue
        if len(self.jobs) >= max_in_flight:
            raise CbatchError(QUEUE_FULL, f"{len(self.jobs)} requests are in flight; retry later or raise --max-queue")
        job = Job(request_id, identity, is_relayed=not self._use_ring.get(identity, False), body=request_body)
        self.jobs[request_id] = job
        self._forward(job)  # held here while the worker (re)starts, sent when it is ready

    def _forward(self, job: Job) -> None:
        if self.worker is not None and job.body is not None:
            self.to_worker(MsgType.WORKER_SUBMIT, {"request_id": job.request_id, "body": job.body})
            job.body = None

    def _owned_job(self, identity: bytes, body: dict) -> Job:
        request_id = field(body, "request_id", int)
        job = self.jobs.get(request_id) or self._finished.get(request_id)
        if job is None or job.owner != identity:
            raise CbatchError(NOT_FOUND, f"no request {request_id} of yours is known")
        return job

    def _cancel(self, identity: bytes, body: dict) -> None:
        job = self._owned_job(identity, body)
        if job.finished_at is None:
            self._cancel_job(job)

    def _cancel_job(self, job: Job) -> None:
        if job.body is None:
            self.to_worker(MsgType.WORKER_CANCEL, {"request_id": job.request_id})
        else:  # never reached the worker: it ends here, with nothing produced
            self._on_event(job.request_id, 0, [], "", "cancelled", {"prompt_tokens": 0, "completion_tokens": 0}, None)

    def _fetch(self, identity: bytes, body: dict) -> None:
        job = self._owned_job(identity, body)
        from_index = field(body, "from_index", int)
        self.num_fetches += 1
        self._send_records(job, job.records[max(from_index, 0):], even_if_empty=True)

    def _health(self, identity: bytes, body: dict) -> None:
        """Also the liveness ping of a waiting client, listing the requests it waits for:
        their finishes are sent again, and ids this client does not own are named lost."""
        status = "draining" if self.is_draining else "ok" if self.worker else "starting"
        worker = self.worker or {}
        lost = []
        for request_id in (field(body, "request_ids", list, optional=True) or [])[:MAX_RECORDS_PER_MESSAGE]:
            job = (self.jobs.get(request_id) or self._finished.get(request_id)) if isinstance(request_id, int) else None
            if job is None or job.owner != identity:
                lost.append(request_id)
            elif job.finish is not None:
                self._deliver_finish(job)
        self._send(identity, MsgType.HEALTH_REPLY, {
            "nonce": body.get("nonce", 0), "status": status, "model": worker.get("model", ""),
            "parallel": self.config.engine.parallel, "worker_pid": worker.get("pid", 0),
            "ctx_per_seq": worker.get("ctx_per_seq", 0), "lost_request_ids": lost,
        })

    def _stats(self, identity: bytes, body: dict) -> None:
        stats = {**self.worker_stats, "parallel": self.config.engine.parallel, "requests_completed": self.requests_completed,
                 "num_in_flight": len(self.jobs), "num_fetches": self.num_fetches}
        stats.setdefault("num_active", 0)
        stats.setdefault("num_queued", 0)
        self._send(identity, MsgType.STATS_REPLY, {"nonce": body.get("nonce", 0), **stats})

    _CLIENT_HANDLERS = {
        MsgType.HELLO: _hello, MsgType.SUBMIT: _submit, MsgType.CANCEL: _cancel, MsgType.FETCH: _fetch,
        MsgType.HEALTH: _health, MsgType.STATS: _stats,
    }

    def _send_records(self, job: Job, records: list[RingRecord], *, even_if_empty: bool = False) -> None:
        """Even an empty answer matters to a FETCH: it lets the reader resume the ring."""
        if not records and even_if_empty:
            self._send(job.owner, MsgType.RECORDS, {"request_id": job.request_id, "records": []})
        for at in range(0, len(records), MAX_RECORDS_PER_MESSAGE):
            rows = [[r.index, r.token_id, r.flags, r.finish, r.count, r.text]
                    for r in records[at:at + MAX_RECORDS_PER_MESSAGE]]
            self._send(job.owner, MsgType.RECORDS, {"request_id": job.request_id, "records": rows})

    # ---- decode worker ------------------------------------------------------------
    def to_worker(self, msg_type: MsgType, body: dict) -> None:
        if self.worker is not None:
            self.control.send_multipart([self.worker["identity"], *pack(msg_type, body)], zmq.NOBLOCK)

    def on_worker_messages(self) -> None:
        while self.control.poll(0):
            identity, *frames = self.control.recv_multipart()
            if identity != self.worker_identity:
                continue  # sent by a worker that has since died: its requests were failed already
            msg_type, body = unpack(frames)  # the worker is ours: a malformed frame is a bug, let it raise
            if msg_type is MsgType.WORKER_READY:
                self.worker = {**body, "identity": identity}
                for job in self.jobs.values():
                    self._forward(job)
            elif msg_type is MsgType.WORKER_FAILED:
                self.worker_failure, self.worker_failure_code = body["message"], body.get("code")
            elif msg_type is MsgType.WORKER_REJECT:
                job = self.jobs.pop(body["request_id"], None)
                if job is not None:
                    self._error(job.owner, body["code"], body["message"], body)
            elif msg_type is MsgType.WORKER_EVENTS:
                for event in body["events"]:
                    self._on_event(*event)
                self.worker_stats = body.get("stats", self.worker_stats)
            self._apply_stalls()

    def _on_event(self, request_id, index, token_ids, text, finish_reason, usage, error) -> None:
        job = self.jobs.get(request_id)
        if job is None:
            return  # already failed (worker restart) or rejected
        finish = FINISH_CODES.get(finish_reason, 0)
        records = event_records(request_id, index, token_ids, text.encode(), finish, index == 0)
        job.records += records
        if job.is_relayed:
            self._send_records(job, records)
        if finish_reason:
            job.finish = {"request_id": request_id, "finish_reason": finish_reason, "usage": usage,
                          "num_records": len(job.records), "error": error}
            self._deliver_finish(job)
            self._retire(job)

    def _retire(self, job: Job) -> None:
        if self.jobs.pop(job.request_id, None) is None:
            return  # already retired
        job.finished_at = now = time.monotonic()
        self.requests_completed += 1
        self._finished[job.request_id] = job
        while self._finished and next(iter(self._finished.values())).finished_at < now - self.config.retention_s:
            _, old = self._finished.popitem(last=False)
            owed = self._undelivered.get(old.owner, {})
            owed.pop(old.request_id, None)
            if not owed:
                self._undelivered.pop(old.owner, None)

    def fail_all(self, code: str, message: str, *, include_held: bool = True) -> None:
        """End in-flight requests with an error. Without include_held, requests still held
        here (not yet sent to a worker) survive, to go to the next worker."""
        for job in list(self.jobs.values()):
            if include_held or job.body is None:
                self._error(job.owner, code, message, {"request_id": job.request_id})
                del self.jobs[job.request_id]

    def cancel_all(self) -> None:
        for job in list(self.jobs.values()):
            self._cancel_job(job)

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
        self.clients.disable_monitor()
        self.disconnects.close()
        self.clients.close()
        self.control.close()
