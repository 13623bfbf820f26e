"""A batch's policy, shared by both clients: bounded pull-ahead over an input that may be
huge or endless, and per-item arrivals."""

from cbatch.errors import CbatchError, INVALID_REQUEST
from cbatch.client.session import Session
from cbatch.client.streams import RequestStream

DEFAULT_MAX_IN_FLIGHT = 64  # requests of one batch outstanding at once


class BatchFeeder:
    """A batch's policy, shared by both clients: items are pulled from the input only as
    requests finish (at most `max_in_flight` outstanding, so a huge or endless input
    streams through), and each round hands over what arrived for the streams that got
    something. The driver waits for `has_arrivals` between rounds."""

    def __init__(self, session: Session, items, max_in_flight: int):
        self._session = session
        self._items = enumerate(items)
        self._max_in_flight = max_in_flight
        self._active: dict[int, RequestStream] = {}
        self._is_exhausted = False

    @property
    def is_done(self) -> bool:
        return self._is_exhausted and not self._active

    def has_arrivals(self) -> bool:
        return any(stream.pending for stream in self._active.values())

    @property
    def streams(self) -> list[RequestStream]:
        """The outstanding requests: what the driver waits on between rounds."""
        return list(self._active.values())

    def fill(self) -> list[tuple[int, CbatchError]]:
        """Submit items until max_in_flight are outstanding; the bad ones' errors."""
        errors = []
        while not self._is_exhausted and len(self._active) < self._max_in_flight:
            position, item = next(self._items, (None, None))
            if position is None:
                self._is_exhausted = True
                break
            try:
                label, body = split_item(item)
                self._active[position] = self._session.submit(body, position if label is None else label)
            except CbatchError as err:
                errors.append((position, err))
        return errors

    def take_arrivals(self) -> list[tuple[int, object]]:
        """(position, chunk or error) for everything that arrived, in arrival order per item."""
        arrivals = []
        for position, stream in list(self._active.items()):
            while stream.pending:
                arrivals.append((position, stream.pending.popleft()))
            if stream.is_done:
                self._session.forget(self._active.pop(position))
        return arrivals

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
