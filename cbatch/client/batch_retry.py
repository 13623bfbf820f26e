"""When a batch holds a request back and sends it again, and when it gives up.

A daemon that drains (SIGTERM, a rolling restart), whose decode worker restarted, whose
queue is full or that is gone for a moment answers with a code that says nothing about the
request itself: the same request sent again later succeeds. Such an answer is never a
result: the request is held, sent again after a bounded exponential backoff with jitter,
and counts against the batch's requests in flight meanwhile, so no more input is read
than there is room for. A held request gives up once `retry_for_s` have passed with
nothing of the batch heard (no token, no answer) since it was held: a daemon that serves other requests of
the batch is alive, however long one line waits for room in its queue.
"""

import random
import time
from dataclasses import dataclass

from cbatch.errors import QUEUE_FULL, RATE_LIMITED, SHUTTING_DOWN, UNAVAILABLE, WORKER_RESTARTED, CbatchError

# shutting_down: a draining daemon; worker_restarted: the decode worker died under the
# request; queue_full: no room now; unavailable: the daemon stopped answering or forgot
# the request, or (over HTTP) the connection failed, timed out, or was answered 502/503/504;
# rate_limited: the API key's tenant is past a limit until its retry_after_s.
TRANSIENT_CODES = frozenset({SHUTTING_DOWN, WORKER_RESTARTED, QUEUE_FULL, UNAVAILABLE, RATE_LIMITED})
INITIAL_BACKOFF_S = 0.25
MAX_BACKOFF_S = 8.0
DEFAULT_RETRY_FOR_S = 300.0
# Over HTTP (http_batch.py), the longest one try of a request may take (a non-streamed
# completion is answered whole, so this bounds the generation too); one that outlasts it is
# a transient failure. Here, beside the other retry settings, so that cbatch-submit tells
# it without importing the HTTP client (the `url` extra).
DEFAULT_REQUEST_TIMEOUT_S = 600.0


def is_transient(error) -> bool:
    return isinstance(error, CbatchError) and error.code in TRANSIENT_CODES


def backoff_s(num_failures: int) -> float:
    """The wait before the next try of a request that failed num_failures (>= 1) times in
    a row: INITIAL_BACKOFF_S doubling to MAX_BACKOFF_S, each a random 50-100 % of that, so
    the requests a restart refused together do not come back together."""
    return min(INITIAL_BACKOFF_S * 2 ** min(num_failures - 1, 16), MAX_BACKOFF_S) * random.uniform(0.5, 1.0)


@dataclass
class Tries:
    """One request's transient failures in a row; `item` is what a batch sends again."""

    item: object = None
    num_failures: int = 0
    held_since_s: float = 0.0  # when the first of them came
    due_s: float = 0.0  # when the next try is due


class Patience:
    """One batch's retry budget: `retry_for_s` of holding with nothing heard."""

    def __init__(self, retry_for_s: float, clock=time.monotonic):
        self.retry_for_s = retry_for_s
        self._clock = clock
        self._progress_s = clock()  # when a request of the batch last got tokens or an answer (or the batch began)

    def on_progress(self) -> None:
        self._progress_s = self._clock()

    def hold(self, tries: Tries, error, retry_after_s: float | None = None) -> float | None:
        """After a try failed with `error`: the wait before the next one (the server's
        Retry-After, else a backoff), with tries.due_s set; None when the error is the
        request's result (not transient) or the patience is spent (then the run stops)."""
        if not is_transient(error):
            return None
        now_s = self._clock()
        tries.num_failures += 1
        if tries.num_failures == 1:
            tries.held_since_s = now_s
        wait_s = backoff_s(tries.num_failures) if retry_after_s is None else retry_after_s
        if now_s + wait_s > max(tries.held_since_s, self._progress_s) + self.retry_for_s:
            return None
        tries.due_s = now_s + wait_s
        return wait_s


def call_held(call, patience: Patience, pause):
    """call()'s result, held through transient failures as a batch's requests are:
    pause(seconds) waits between tries. Raises the last failure once the patience is spent."""
    tries = Tries()
    while True:
        try:
            result = call()
        except CbatchError as err:
            wait_s = patience.hold(tries, err, err.retry_after_s)
            if wait_s is None:
                raise
            pause(wait_s)
        else:
            patience.on_progress()
            return result
