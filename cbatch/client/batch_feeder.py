"""A batch's policy, shared by both clients: bounded pull-ahead over an input that may be
huge or endless, per-item arrivals, and (when given a Patience) holding and sending again
the requests a daemon refused for a moment (cbatch.client.batch_retry)."""

import time
from collections import deque

from cbatch.client.batch_retry import Patience, Tries
from cbatch.client.liveness import LIVENESS_S
from cbatch.client.session import Session
from cbatch.client.streams import RequestStream
from cbatch.errors import INVALID_REQUEST, UNAVAILABLE, CbatchError

DEFAULT_MAX_IN_FLIGHT = 64  # requests of one batch outstanding at once


class Choices(list):
    """The request bodies of one request's n choices, as one batch item: each takes its own
    position, and they end together: the first to fail cancels the others at once, and
    those end with the same error (a caller that wanted n completions gets none)."""


class BatchFeeder:
    """A batch's policy, shared by both clients: items are pulled from the input only as
    requests finish (at most `max_in_flight` outstanding, so a huge or endless input
    streams through), and each round hands over what arrived for the streams that got
    something. The driver waits for `has_arrivals` between rounds. A Choices item takes
    one position per choice, numbered on in input order.

    With a `patience`, an item that fails with a transient code is held and sent again
    (batch_retry); a held item counts as outstanding. Only when the patience is spent does
    its error arrive. An item's chunks then arrive together with its last one: a request
    sent again starts over, and nothing of the attempt that failed may have been handed on."""

    def __init__(self, session: Session, items, max_in_flight: int, patience: Patience | None = None,
                 is_whole: bool = False):
        self._session = session
        self._is_whole = is_whole  # the caller wants each item whole: its streams wake it less (RequestStream)
        self._items = iter(items)
        self._max_in_flight = max_in_flight
        self._patience = patience
        self._active: dict[int, RequestStream] = {}
        self._queued: deque[tuple[int, object]] = deque()  # (position, item) pulled, not yet submitted
        self._next_position = 0
        self._siblings: dict[int, list[int]] = {}  # position of a choice -> the positions of its request's choices
        self._is_exhausted = False
        # With a patience: position -> its tries, from its first send until it ends; the
        # held ones (waiting to be sent again); the chunks of the running ones so far.
        self._tries: dict[int, Tries] = {}
        self._held: dict[int, Tries] = {}
        self._chunks: dict[int, list] = {}
        self._hello_s = 0.0  # when a daemon that stopped answering was last greeted

    @property
    def is_done(self) -> bool:
        return self._is_exhausted and not self._active and not self._queued and not self._held

    def has_arrivals(self) -> bool:
        """Something to hand over, or a held item due to be sent again."""
        return any(stream.pending for stream in self._active.values()) or self._is_retry_due()

    def _is_retry_due(self) -> bool:
        now_s = time.monotonic()
        return any(tries.due_s <= now_s for tries in self._held.values())

    @property
    def streams(self) -> list[RequestStream]:
        """The outstanding requests: what the driver waits on between rounds."""
        return list(self._active.values())

    def _pull(self) -> bool:
        """Queue the input's next item (each choice of a Choices); False at its end."""
        item = next(self._items, None)
        if item is None:
            self._is_exhausted = True
            return False
        choices = item if isinstance(item, Choices) else [item]
        positions = list(range(self._next_position, self._next_position + len(choices)))
        self._next_position += len(choices)
        self._queued.extend(zip(positions, choices))
        if isinstance(item, Choices):
            self._siblings.update(dict.fromkeys(positions, positions))
        return True

    def fill(self) -> list[tuple[int, CbatchError]]:
        """Send the held items that are due again, then submit new ones until max_in_flight
        are outstanding (held ones included); the errors that ended items."""
        errors = []
        now_s = time.monotonic()
        due_positions = [position for position, tries in self._held.items() if tries.due_s <= now_s]
        if due_positions:
            self._greet_if_gone(now_s)
        for position in due_positions:
            errors += self._submit(position, self._held.pop(position).item)
        while len(self._active) + len(self._held) < self._max_in_flight and (
                self._queued or (not self._is_exhausted and self._pull())):
            position, item = self._queued.popleft()
            errors += self._submit(position, item)
        return errors

    def _greet_if_gone(self, now_s: float) -> None:
        """A session that gave its daemon up refuses every submit at once and sends nothing:
        a HELLO (at most every LIVENESS_S) is what a daemon restarted on the endpoint
        answers, which makes the session usable again."""
        if self._session.failure is None or now_s - self._hello_s < LIVENESS_S:
            return
        self._hello_s = now_s
        try:
            self._session.hello()
        except CbatchError:
            pass  # nothing takes it yet: the next due item greets again

    def _submit(self, position: int, item) -> list[tuple[int, CbatchError]]:
        if self._patience is not None:
            self._tries.setdefault(position, Tries(item))
        try:
            label, body = split_item(item)
            stream = self._active[position] = self._session.submit(body, position if label is None else label)
            stream.is_whole = self._is_whole  # nothing arrived yet: the caller's thread reads what arrives
        except CbatchError as err:
            return self._failed(position, err)
        return []

    def take_arrivals(self) -> list[tuple[int, object]]:
        """(position, chunk or error) for everything that arrived, in arrival order per item."""
        arrivals = []
        for position, stream in list(self._active.items()):
            while stream.pending and position in self._active:
                chunk = stream.pending.popleft()
                if isinstance(chunk, CbatchError):
                    arrivals += self._failed(position, chunk)
                elif self._patience is None:
                    arrivals.append((position, chunk))
                else:
                    self._patience.on_progress()
                    self._chunks.setdefault(position, []).append(chunk)
                    if chunk.finish_reason:
                        arrivals += ((position, whole) for whole in self._chunks.pop(position))
            self._session.taken(stream)
            if stream.is_done and position in self._active:
                self._session.forget(self._active.pop(position))
                self._siblings.pop(position, None)
                self._tries.pop(position, None)
                self._release_one()
        return arrivals

    def _release_one(self) -> None:
        """A request of the batch ended, so the daemon serves and has room for one more:
        the held item due first is sent in the next round instead of waiting out its
        backoff (a full queue is then kept full, not left idle by backing off)."""
        if self._held:
            self._held[min(self._held, key=lambda position: self._held[position].due_s)].due_s = 0.0

    def _failed(self, position: int, error: CbatchError) -> list[tuple[int, CbatchError]]:
        """An item failed: held to be sent again when its error is transient and patience
        is left, else ended (with its request's other choices). Returns the arrivals."""
        tries = self._tries.get(position)
        if tries is None or self._patience.hold(tries, error, error.retry_after_s) is None:
            return self._ended(position, error)
        stream = self._active.pop(position, None)
        if stream is not None:
            self._session.forget(stream)
            if error.code == UNAVAILABLE:  # a daemon that comes back may hold it still: it is sent anew
                self._cancel(stream)
        self._chunks.pop(position, None)
        self._held[position] = tries
        return []

    def _cancel(self, stream: RequestStream) -> None:
        try:
            self._session.cancel(stream.request_id)
        except CbatchError:
            pass  # the daemon takes nothing: it has not got the request either

    def _ended(self, position: int, error: CbatchError) -> list[tuple[int, CbatchError]]:
        """An item failed: it and its request's other choices, running, queued or held, end
        with its error. Returns those (position, error) arrivals."""
        ended = []
        for sibling in self._siblings.pop(position, [position]):
            self._siblings.pop(sibling, None)
            self._tries.pop(sibling, None)
            self._chunks.pop(sibling, None)
            stream = self._active.pop(sibling, None)
            is_held = self._held.pop(sibling, None) is not None
            if stream is not None:
                if not stream.is_done:
                    self._session.cancel(stream.request_id)
                self._session.forget(stream)
            elif sibling != position and not is_held and not any(queued == sibling for queued, _ in self._queued):
                continue  # already ended
            ended.append((sibling, error))
        ended_positions = {sibling for sibling, _ in ended}
        self._queued = deque(entry for entry in self._queued if entry[0] not in ended_positions)
        return ended

    def close(self) -> None:
        """Cancel what is still outstanding (the caller stopped early)."""
        if self._session.is_closed:
            return
        for stream in self._active.values():
            self._session.cancel(stream.request_id)
            self._session.forget(stream)
        self._active.clear()


def split_item(item) -> tuple[object, dict]:
    """A batch item is a prompts.jsonl line: {"id": ..., "prompt"/"messages": ..., params},
    or a plain prompt string. Returns (the caller's id or None, the request body)."""
    if isinstance(item, CbatchError):
        raise item  # the caller already knows this item is bad (e.g. a line that is not JSON)
    if isinstance(item, str):
        return None, {"prompt": item}
    if not isinstance(item, dict):
        raise CbatchError(INVALID_REQUEST, "each batch item must be a dict or a prompt string")
    body = dict(item)
    return body.pop("id", None), body
