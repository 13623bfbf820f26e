"""A batch's policy, shared by both clients: bounded pull-ahead over an input that may be
huge or endless, and per-item arrivals."""

from collections import deque

from cbatch.errors import CbatchError, INVALID_REQUEST
from cbatch.client.session import Session
from cbatch.client.streams import RequestStream

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
    one position per choice, numbered on in input order."""

    def __init__(self, session: Session, items, max_in_flight: int):
        self._session = session
        self._items = iter(items)
        self._max_in_flight = max_in_flight
        self._active: dict[int, RequestStream] = {}
        self._queued: deque[tuple[int, object]] = deque()  # (position, item) pulled, not yet submitted
        self._next_position = 0
        self._siblings: dict[int, list[int]] = {}  # position of a choice -> the positions of its request's choices
        self._is_exhausted = False

    @property
    def is_done(self) -> bool:
        return self._is_exhausted and not self._active and not self._queued

    def has_arrivals(self) -> bool:
        return any(stream.pending for stream in self._active.values())

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
        """Submit items until max_in_flight are outstanding; the bad ones' errors."""
        errors = []
        while len(self._active) < self._max_in_flight and (self._queued or (not self._is_exhausted and self._pull())):
            position, item = self._queued.popleft()
            try:
                label, body = split_item(item)
                self._active[position] = self._session.submit(body, position if label is None else label)
            except CbatchError as err:
                errors += self._ended(position, err)
        return errors

    def take_arrivals(self) -> list[tuple[int, object]]:
        """(position, chunk or error) for everything that arrived, in arrival order per item."""
        arrivals = []
        for position, stream in list(self._active.items()):
            while stream.pending and position in self._active:
                chunk = stream.pending.popleft()
                if isinstance(chunk, CbatchError):
                    arrivals += self._ended(position, chunk)
                else:
                    arrivals.append((position, chunk))
            if stream.is_done and position in self._active:
                self._session.forget(self._active.pop(position))
                self._siblings.pop(position, None)
        return arrivals

    def _ended(self, position: int, error: CbatchError) -> list[tuple[int, CbatchError]]:
        """An item failed: it and its request's other choices, running or queued, end with
        its error. Returns those (position, error) arrivals."""
        ended = []
        for sibling in self._siblings.pop(position, [position]):
            self._siblings.pop(sibling, None)
            stream = self._active.pop(sibling, None)
            if stream is not None:
                if not stream.is_done:
                    self._session.cancel(stream.request_id)
                self._session.forget(stream)
            elif sibling != position and not any(queued == sibling for queued, _ in self._queued):
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
