"""Applies the prepared commands to the engine between steps, on the decode loop's thread."""

import logging
import queue

from cbatch.errors import DEADLINE_EXCEEDED, CbatchError
from cbatch.workers.decode.io_thread import WorkerIO
from cbatch.workers.decode.preparer import rejection
from cbatch.workers.decode.publisher import EventPublisher
from cbatch.workers.engine.embedder import Embedder, EmbedJob
from cbatch.workers.engine.engine import Engine
from cbatch.workers.engine.sequence import Sequence
from cbatch.workers.messages import (
    WorkerCancel,
    WorkerCounted,
    WorkerEmbedCancel,
    WorkerEmbedded,
    WorkerPause,
    WorkerReject,
    WorkerStop,
)

log = logging.getLogger(__name__)
# An idle worker reports its stats, which also stamps the ring's heartbeat that the
# supervisor's watchdog reads, at least this often.
IDLE_WAIT_S = 0.5
# Commands applied (and refusals of expired requests sent) between two steps at most: a
# flood of thousands of requests reaching the worker at once, or expiring at once, is
# handled over several steps instead of stalling the running streams for all of them
# (each costs tens of µs). The rest wait, in order, for the next step.
MAX_COMMANDS_PER_STEP = 256


class CommandHandler:
    """Applies prepared commands to the engine between steps."""

    def __init__(self, engine: Engine, embedder: Embedder, io: WorkerIO, inbox: queue.SimpleQueue,
                 publisher: EventPublisher):
        self._engine, self._embedder, self._io, self._inbox, self._publisher = engine, embedder, io, inbox, publisher
        self.is_stopped = False  # a WorkerStop was applied
        # Cancels that overtook their submit in the preparer: request id -> is_shutdown.
        self._early_cancels: dict[int, bool] = {}
        self._early_embed_cancels: set[int] = set()  # the same for embedding requests
        self._handlers = {Sequence: self._add_sequence, WorkerReject: self._send_reject, WorkerCancel: self._cancel,
                          WorkerPause: self._pause, EmbedJob: self._add_embed, WorkerEmbedCancel: self._cancel_embed,
                          WorkerCounted: self._io.send,  # a count the preparer made: straight back
                          WorkerEmbedded: self._send_embedded, WorkerStop: self._stop}

    def apply_pending(self, wait_s: float) -> bool:
        """Apply every command waiting (first waiting up to wait_s, at most IDLE_WAIT_S, for
        one: the engine is idle); return whether the loop goes on."""
        expired_ids = self._engine.expired_while_queued  # thousands may expire at once: sent over several steps
        for request_id in expired_ids[:MAX_COMMANDS_PER_STEP]:
            self._io.send(WorkerReject(request_id, DEADLINE_EXCEEDED, "the request's timeout passed while it waited "
                                                                      "in the queue; nothing was generated"))
        del expired_ids[:MAX_COMMANDS_PER_STEP]
        wait_for_one = wait_s > 0 and not expired_ids
        if wait_for_one:
            self._publisher.send_stats()  # the engine just went idle: report zero active
        try:
            item = self._inbox.get(timeout=min(wait_s, IDLE_WAIT_S)) if wait_for_one else self._inbox.get_nowait()
            for _ in range(MAX_COMMANDS_PER_STEP - 1):
                self._apply(item)
                item = self._inbox.get_nowait()
            self._apply(item)
        except queue.Empty:
            pass
        return not self.is_stopped

    def _apply(self, item) -> None:
        """item: a prepared Sequence or EmbedJob, or a refusal, from the preparer, or a
        command from the I/O thread. A message the worker takes no command from (a
        front-end bug) is logged and dropped: the loop goes on."""
        handler = self._handlers.get(type(item))
        if handler is None:
            log.warning("cbatch-worker: the decode worker ignores a %s from the front-end", type(item).__name__)
            return
        handler(item)

    def _add_sequence(self, seq: Sequence) -> None:
        self._io.preparing.discard(seq.request_id)
        try:
            self._engine.add(seq)
        except (CbatchError, ValueError) as err:
            self._io.send(rejection(seq.request_id, err))
        if seq.request_id in self._early_cancels:
            self._engine.cancel(seq.request_id, self._early_cancels.pop(seq.request_id))

    def _send_reject(self, reject: WorkerReject) -> None:
        self._io.preparing.discard(reject.request_id)
        self._early_cancels.pop(reject.request_id, None)
        self._io.send(reject)

    def _cancel(self, cancel: WorkerCancel) -> None:
        if not self._engine.cancel(cancel.request_id, cancel.is_shutdown) and cancel.request_id in self._io.preparing:
            self._early_cancels[cancel.request_id] = cancel.is_shutdown

    def _pause(self, pause: WorkerPause) -> None:  # one still being prepared has produced nothing to pile up
        self._engine.pause(pause.request_id, pause.is_paused)

    def _add_embed(self, job: EmbedJob) -> None:
        self._io.preparing_embeds.discard(job.embed_id)
        if job.embed_id in self._early_embed_cancels:
            self._early_embed_cancels.remove(job.embed_id)
            self._io.send(WorkerEmbedded(job.embed_id))  # cancelled: nothing decoded
        else:
            self._embedder.add(job)

    def _cancel_embed(self, cancel: WorkerEmbedCancel) -> None:
        """Answered once, with what its tenant is charged: now, later (still being
        prepared), or by the reply already on its way (finished)."""
        num_done_tokens = self._embedder.cancel(cancel.embed_id)
        if num_done_tokens is not None:
            self._io.send(WorkerEmbedded(cancel.embed_id, num_tokens=num_done_tokens))
        elif cancel.embed_id in self._io.preparing_embeds:
            self._early_embed_cancels.add(cancel.embed_id)

    def _send_embedded(self, embedded: WorkerEmbedded) -> None:  # an embedding request the preparer refused
        self._io.preparing_embeds.discard(embedded.embed_id)
        self._early_embed_cancels.discard(embedded.embed_id)
        self._io.send(embedded)

    def _stop(self, _: WorkerStop) -> None:
        self.is_stopped = True
