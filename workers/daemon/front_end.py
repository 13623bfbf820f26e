"""The front-end: the one socket clients talk to. It never touches the model.

It validates every client message, keeps the bounded table of in-flight requests
(request_table), forwards submits and cancels to the decode worker (worker_link), and
relays the worker's events: the finish (with usage and the record count) to every owner,
and the records themselves to clients that do not read the ring (record_relay). The
supervisor owns the worker link (it starts and stops workers); the front-end only sends
requests over it and reads what it knows of the live worker.
"""

import logging
import time

import msgspec
import zmq

from cbatch.config import DaemonConfig
from cbatch.errors import INTERNAL, INVALID_REQUEST, SHUTDOWN_MESSAGE, SHUTTING_DOWN, CbatchError
from cbatch.ipc.records import TokenEvent, frame_events
from cbatch.model import served_model_names
from cbatch.params import BATCH, parse_request
from cbatch.protocol import MAX_FRAME_BYTES, MsgType, ProtocolError, field, reply_ids, unpack
from cbatch.workers.daemon.client_link import ClientLink
from cbatch.workers.daemon.count_relay import CountRelay
from cbatch.workers.daemon.embed_relay import EmbedRelay
from cbatch.workers.daemon.handshakes import Handshakes
from cbatch.workers.daemon.probation import Probation, request_fingerprint
from cbatch.workers.daemon.quarantine import Quarantine
from cbatch.workers.daemon.record_relay import MAX_RECORDS_PER_MESSAGE, RecordRelay
from cbatch.workers.daemon.request_table import RequestTable, TrackedRequest
from cbatch.workers.daemon.stats_reply import StatsReply
from cbatch.workers.daemon.tenant_ledger import TenantLedger
from cbatch.workers.daemon.worker_link import WorkerLink
from cbatch.workers.messages import (
    WorkerCancel,
    WorkerCounted,
    WorkerEmbedded,
    WorkerEvents,
    WorkerPause,
    WorkerReady,
    WorkerReject,
    WorkerSubmit,
    encode,
)

log = logging.getLogger("cbatch.daemon.front_end")

MAX_REQUEST_ID = (1 << 63) - 1


BACKLOG, CLIENT_BUFFER = "backlog", "client buffer"  # why a request is paused (TrackedRequest.pause_reasons)


class FrontEnd:
    def __init__(self, zctx: zmq.Context, config: DaemonConfig, worker: WorkerLink, ring_name: str,
                 tick_endpoint: str):
        self.config = config
        # what a request's `model` may name
        self.model_names = served_model_names(config.engine.model_path, config.aliases)
        self.worker = worker
        self.clients = ClientLink(zctx, config)
        self.handshakes = Handshakes(self.clients, config, worker, ring_name, tick_endpoint)
        self.relay = RecordRelay(self.clients)
        engine = config.engine
        ledger = TenantLedger(config.api_keys_file)
        self.requests = RequestTable(engine.max_in_flight, config.retention_s, ledger)
        self.embeds = EmbedRelay(self.clients, worker, engine.parallel + engine.max_queue, ledger)
        self.counts = CountRelay(self.clients, worker, engine.parallel + engine.max_queue)
        self._is_draining = False
        self.quarantine = Quarantine()  # shapes of requests that crashed the worker, refused
        self.probation = Probation(self.requests.active)  # suspects of crashes no one request was blamed for
        self.num_fetches = 0  # FETCHes answered: each one is a reader the ring lapped (or a lost record)
        self.stats_reply = StatsReply(config)

    @property
    def client_sockets(self) -> list:
        """What the supervisor polls: client disconnects, client messages."""
        return [self.clients.disconnects, self.clients.socket]

    @property
    def num_in_flight(self) -> int:
        return len(self.requests.active) + self.embeds.num_pending

    @property
    def num_ended(self) -> int:
        return sum(self.requests.num_ended_by_outcome.values())

    def start_draining(self) -> None:
        """From now on a submit gets SHUTTING_DOWN; requests in flight run on."""
        self._is_draining = True

    # ---- clients ----------------------------------------------------------------
    def on_client_messages(self) -> None:
        self.requests.expire(time.monotonic())  # also on an idle daemon, before a FETCH could find them
        for identity, frames in self.clients.receive(self._on_disconnect, self._resend_owed):
            body: dict = {}
            try:
                msg_type, body = unpack(frames)
                handler = self._CLIENT_HANDLERS.get(msg_type)
                if handler is None:
                    raise ProtocolError(f"message type {msg_type.name} is not sent by clients")
                handler(self, identity, body)
                self.handshakes.welcome_unknown(identity)
            except ProtocolError as err:
                self._error(identity, INVALID_REQUEST, str(err), body or reply_ids(frames))
            except CbatchError as err:
                self._error(identity, err.code, err.message, body, err.retry_after_s)
            except Exception as err:  # a bug must cost one reply, not the daemon
                log.exception("front-end failed on a client message")
                message = f"the front-end failed on this message: {type(err).__name__}"
                self._error(identity, INTERNAL, message, body)
        self._cancel_stalled()

    def on_disconnects(self) -> None:
        self.clients.take_disconnects(self._on_disconnect)

    def _on_disconnect(self, identity: bytes, may_return: bool) -> None:
        """The client's connection died. One that may come back (it was not seen to die)
        keeps its requests for the reconnect grace; otherwise nobody will read them."""
        active = self.requests.active_of(identity)
        if may_return and active and self.config.reconnect_grace_s:
            self.clients.wait_for_return(identity, time.monotonic())
            return
        self.clients.forget(identity)
        self.handshakes.forget(identity)
        for tracked in active:
            self._cancel_tracked(tracked)

    def flush_clients(self) -> None:
        """Send what waits for slow clients; pause the requests whose records pile up for
        one that reads slower than they come, and let them go on as it catches up; cancel
        the requests of one that stopped reading; hand the worker the next request on
        probation once a turn is free (every round of the loop: a turn can end by time)."""
        self.clients.flush(time.monotonic())
        changes = self.clients.pauses.changes
        while changes:
            request_id, is_paused = changes.popitem()
            self._set_paused(self.requests.active.get(request_id), BACKLOG, is_paused)
        self._cancel_stalled()
        if self.worker.ready is not None:  # a restarting worker gets every held request when ready
            for tracked in self.probation.next_turn():  # held while another request on probation had its turn
                self._forward(tracked)

    def _set_paused(self, tracked: TrackedRequest | None, reason: str, is_paused: bool) -> None:
        """The worker pauses a request while any reason to holds, and is told when that changes."""
        if tracked is None or tracked.is_held:  # ended, or not at a worker: nothing to pause
            return
        was_paused = bool(tracked.pause_reasons)
        if is_paused:
            tracked.pause_reasons.add(reason)
        else:
            tracked.pause_reasons.discard(reason)
        if bool(tracked.pause_reasons) != was_paused:
            self.worker.send(WorkerPause(tracked.request_id, not was_paused))

    def _pause(self, identity: bytes, body: dict) -> None:
        """No reply: a pause that comes after its request ended (or for another's) changes nothing."""
        tracked = self.requests.active.get(field(body, "request_id", int))
        if tracked is not None and tracked.owner == identity:
            self._set_paused(tracked, CLIENT_BUFFER, field(body, "is_paused", bool))

    def _cancel_stalled(self) -> None:
        """A client that takes nothing for MAX_STALL_S stops costing the others: its requests are
        cancelled. What it missed stays fetchable; the finishes its dropped backlog held are owed to it."""
        while self.clients.lost_finish_ids:
            tracked = self.requests.get(self.clients.lost_finish_ids.pop())
            if tracked is not None:
                self.requests.set_delivered(tracked, False)
        while self.clients.newly_stalled:
            for tracked in self.requests.active_of(self.clients.newly_stalled.pop()):
                self._cancel_tracked(tracked)

    def _resend_owed(self, identity: bytes) -> None:
        """The stalled client speaks again: resend the finishes it may have lost (it then
        fetches the records it lacks)."""
        for tracked in self.requests.owed_to(identity):
            if not self._deliver_finish(tracked):
                break  # its queue is full again: the rest waits for its next message

    def _deliver_finish(self, tracked: TrackedRequest) -> bool:
        """Only what a client is owed is ever re-sent: a flooding client that stalls costs the loop
        one failed send per message, not a pass over every finished request."""
        is_delivered = self.clients.send(tracked.owner, MsgType.FINISHED, tracked.finish)
        self.requests.set_delivered(tracked, is_delivered)
        return is_delivered

    def _error(self, identity: bytes, code: str, message: str, body: dict,
               retry_after_s: float | None = None) -> None:
        """Every reply to a request names it (and a reply to a nonce its nonce)."""
        reply = {"code": code, "message": message}
        if retry_after_s is not None:
            reply["retry_after_s"] = retry_after_s
        for key in ("request_id", "nonce"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                reply[key] = body[key]
        self.clients.send(identity, MsgType.ERROR, reply)

    def _submit(self, identity: bytes, body: dict) -> None:
        request_id = field(body, "request_id", int)
        if not 1 <= request_id <= MAX_REQUEST_ID:
            raise ProtocolError("request_id must be in [1, 2**63 - 1]")
        request_body = field(body, "body", dict)
        # Bad input is refused here, before it costs the worker anything; the worker takes
        # the parsed request as it is, encoded once here (and kept so until a worker is ready).
        request = parse_request(request_id, request_body)
        is_batch, now_s = request.priority == BATCH, time.monotonic()
        deadline_s = self.config.deadline_s(request.timeout_s, is_batch, now_s)
        # The keys file's weight, whatever a client said: the worker shares the steps by it.
        request = msgspec.structs.replace(request, tenant_weight=self.requests.ledger.weight(request.tenant))
        submit = encode(worker_submit := WorkerSubmit(request, deadline_s))
        if len(submit[1]) > MAX_FRAME_BYTES:  # its floats may have been narrower in the caller's encoding
            raise CbatchError(INVALID_REQUEST, "the request is too large to forward")
        if self._is_draining:
            raise CbatchError(SHUTTING_DOWN, "the daemon is shutting down and accepts no new requests")
        shape = self.quarantine.admit(request, fingerprint := request_fingerprint(worker_submit, submit[1]))
        # Log-probabilities do not fit the ring's records: such a request is relayed whole.
        wants_logprobs = request.params.logprobs is not None
        tracked = TrackedRequest(
            request_id, identity, is_relayed=wants_logprobs or not self.handshakes.reads_ring(identity),
            submit=submit, logprobs={} if wants_logprobs else None, is_batch=is_batch, deadline_s=deadline_s,
            shape=shape, tenant=request.tenant, fingerprint=fingerprint)
        self.requests.add(tracked, now_s)
        self._forward(tracked)  # held here while the worker (re)starts, sent when it is ready

    def _forward(self, tracked: TrackedRequest) -> None:
        if self.worker.ready is not None and tracked.is_held and self.probation.take_turn(tracked):
            self.worker.send_encoded(tracked.submit)
            tracked.submit = None

    def _cancel(self, identity: bytes, body: dict) -> None:
        tracked = self.requests.owned(identity, field(body, "request_id", int))
        if tracked.finish is None:
            self._cancel_tracked(tracked)

    def _cancel_tracked(self, tracked: TrackedRequest) -> None:
        if not tracked.is_held:
            self.worker.send(WorkerCancel(tracked.request_id))
        else:  # never reached the worker: it ends here, with nothing produced
            usage = {"prompt_tokens": 0, "completion_tokens": 0}
            event = TokenEvent(tracked.request_id, [], "", "cancelled", usage)
            self._on_step(WorkerEvents.of_step([event], frame_events([event])[0]), is_front_end_finish=True)

    def _fetch(self, identity: bytes, body: dict) -> None:
        tracked = self.requests.owned(identity, field(body, "request_id", int))
        self.num_fetches += 1
        self.relay.send(tracked, max(field(body, "from_index", int), 0), even_if_empty=True)

    def _health(self, identity: bytes, body: dict) -> None:
        """Also the liveness ping of a waiting client, listing the requests it waits for:
        their finishes are sent again, and ids this client does not own are named lost."""
        status = "draining" if self._is_draining else "ok" if self.worker.ready else "starting"
        ready = self.worker.ready
        lost = []
        for request_id in (field(body, "request_ids", list, optional=True) or [])[:MAX_RECORDS_PER_MESSAGE]:
            tracked = self.requests.get(request_id) if isinstance(request_id, int) else None
            if tracked is None or tracked.owner != identity:
                lost.append(request_id)
            elif tracked.finish is not None:
                self._deliver_finish(tracked)
        self.clients.send(identity, MsgType.HEALTH_REPLY, {
            "nonce": body.get("nonce", 0), "status": status, "model": ready.model if ready else "",
            "parallel": self.config.engine.parallel, "worker_pid": ready.pid if ready else 0,
            "ctx_per_seq": ready.ctx_per_seq if ready else 0, "lost_request_ids": lost,
            "model_names": self.model_names, "reasoning": ready.reasoning if ready else None,
            "batch_jobs": self.stats_reply.batch_jobs_health(),
        })

    def _stats(self, identity: bytes, body: dict) -> None:
        self.clients.send(identity, MsgType.STATS_REPLY, {"nonce": body.get("nonce", 0), **self.stats_reply.of(self)})

    _CLIENT_HANDLERS = {
        MsgType.HELLO: lambda self, identity, body: self.handshakes.hello(identity, body),
        MsgType.SUBMIT: _submit,
        MsgType.CANCEL: _cancel,
        MsgType.PAUSE: _pause,
        MsgType.FETCH: _fetch,
        MsgType.HEALTH: _health,
        MsgType.STATS: _stats,
        MsgType.EMBED: lambda self, identity, body: self.embeds.on_embed(identity, body, self._is_draining),
        MsgType.EMBED_CANCEL: lambda self, identity, body: self.embeds.on_cancel(identity, field(body, "nonce", int)),
        MsgType.COUNT: lambda self, identity, body: self.counts.on_count(identity, body, self._is_draining),
    }

    # ---- decode worker ------------------------------------------------------------
    def on_worker_messages(self) -> None:
        for message in self.worker.receive():
            if isinstance(message, WorkerReady):  # what was held for it, interactive requests first
                self.handshakes.welcome_all()
                for tracked in sorted(self.requests.active.values(), key=lambda tracked: tracked.is_batch):
                    self._forward(tracked)
                self.embeds.forward_held()
            elif isinstance(message, WorkerEmbedded):
                self.embeds.on_embedded(message)
            elif isinstance(message, WorkerCounted):
                self.counts.on_counted(message)
            elif isinstance(message, WorkerReject):
                tracked = self.requests.active.get(message.request_id)
                if tracked is not None:
                    self.fail(tracked, message.code, message.message)
            elif isinstance(message, WorkerEvents):
                self._on_step(message)
            self._cancel_stalled()

    def _on_step(self, step: WorkerEvents, *, is_front_end_finish: bool = False) -> None:
        """A step's records are kept and relayed (record_relay), then its ends are
        delivered. is_front_end_finish: a finish the front-end made itself; the worker
        never wrote it to the ring, so even a ring reader gets its records sent."""
        active = self.requests.active
        self.relay.keep_step(active, step, relay_all=is_front_end_finish)
        for request_id, finish_reason, usage, error, error_code, stop_string in step.ends:
            tracked = active.get(request_id)
            if tracked is None:
                continue  # already failed (worker restart) or rejected
            finish = {"request_id": request_id, "finish_reason": finish_reason, "usage": usage,
                      "num_records": tracked.num_records, "error": error, "error_code": error_code,
                      **({"stop_string": stop_string} if stop_string else {})}
            self.requests.finish(tracked, finish, time.monotonic())
            self._deliver_finish(tracked)

    def fail(self, tracked: TrackedRequest, code: str, message: str) -> None:
        self.requests.fail(tracked, code, time.monotonic())
        self._error(tracked.owner, code, message, {"request_id": tracked.request_id})

    def fail_all(self, code: str, message: str, *, include_held: bool = True) -> None:
        """End in-flight requests with an error. Without include_held, requests still held
        here (not yet sent to a worker) survive, to go to the next worker."""
        for tracked in list(self.requests.active.values()):
            if include_held or not tracked.is_held:
                self.fail(tracked, code, message)
        self.embeds.fail_all(code, message, include_held)
        self.counts.fail_all(code, message)

    def cancel_all(self) -> None:
        """The drain's end: what runs ends with shutting_down, which tells every client the
        request was not finished and may be sent again (never `cancelled`, which only
        the caller asks for)."""
        for tracked in list(self.requests.active.values()):
            if tracked.is_held:
                self.fail(tracked, SHUTTING_DOWN, SHUTDOWN_MESSAGE)
            else:
                self.worker.send(WorkerCancel(tracked.request_id, is_shutdown=True))

    def close(self) -> None:
        self.clients.close()
