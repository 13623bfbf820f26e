"""Publishes each step: records into the ring, a tick to wake local readers, the events
and (now and then) the engine's stats to the front-end."""

import time
from operator import attrgetter

import zmq

from cbatch.ipc.records import TokenEvent
from cbatch.ipc.ring import RingWriter
from cbatch.workers.decode.io_thread import WorkerIO
from cbatch.workers.engine.embedder import Embedder
from cbatch.workers.engine.engine import Engine
from cbatch.workers.messages import WorkerEvents

STATS_INTERVAL_S = 0.25  # at most this stale, the stats the front-end answers with
_REQUEST_ID = attrgetter("request_id")


def one_event_per_request(events: list[TokenEvent]) -> list[TokenEvent]:
    """A step may make two events for one request (a fork samples its first token from the
    last decode's row, then its deadline passes in the same step): they become one, in
    order, because each event's records are numbered from the request's next index before
    any is framed. A finishing event is a request's last, so its finish, usage and error
    are the merged event's."""
    if len(set(map(_REQUEST_ID, events))) == len(events):
        return events
    merged: dict[int, TokenEvent] = {}
    for event in events:
        first = merged.setdefault(event.request_id, event)
        if first is event:
            continue
        first.token_ids = first.token_ids + event.token_ids
        first.text += event.text
        if first.logprobs is not None or event.logprobs is not None:
            first.logprobs = (first.logprobs or []) + (event.logprobs or [])
        if event.finish_reason:
            first.finish_reason, first.usage = event.finish_reason, event.usage
            first.error, first.error_code = event.error, event.error_code
    return list(merged.values())


class EventPublisher:
    """Writes each step's outputs to the ring, ticks readers, and tells the front-end."""

    def __init__(self, engine: Engine, embedder: Embedder, ring, io: WorkerIO, tick: zmq.Socket):
        self._engine, self._embedder, self._io, self._tick = engine, embedder, io, tick
        self._writer = RingWriter(ring)
        self._writer.heartbeat()  # before READY: the previous worker's stamp must not count
        self._next_index: dict[int, int] = {}
        self._stats_sent_at = 0.0

    def publish(self, events: list[TokenEvent]) -> None:
        if not events:  # a step of prompt chunks only: nothing to tell but liveness and stats
            if time.monotonic() - self._stats_sent_at >= STATS_INTERVAL_S:
                self.send_stats()
            else:
                self._writer.heartbeat()
            return
        events = one_event_per_request(events)
        next_index = self._next_index
        for event in events:
            event.index = next_index.get(event.request_id, 0)
        next_indices, framed = self._writer.publish_step(events)
        next_index.update(zip([event.request_id for event in events], next_indices))
        for request_id in [event.request_id for event in events if event.finish_reason]:
            del next_index[request_id]
        # Invariant: the records are in the ring before the tick and before the front-end
        # hears of them, so a reader told of a finish finds every record already there.
        self._tick.send(b"", zmq.NOBLOCK)
        is_stats_due = time.monotonic() - self._stats_sent_at >= STATS_INTERVAL_S
        self._io.send(WorkerEvents.of_step(events, framed, self._stats() if is_stats_due else None))

    def send_stats(self) -> None:
        self._writer.heartbeat()  # idle is alive too: the supervisor's watchdog reads this
        self._io.send(WorkerEvents(b"", stats=self._stats()))

    def _stats(self) -> dict:
        self._stats_sent_at = time.monotonic()
        return {**self._engine.snapshot(), **self._embedder.snapshot()}
