"""When a client pings the daemon about requests that went quiet, and when it gives the
daemon up.

A request that hears nothing for LIVENESS_S is named in a ping to the front-end, and a
daemon that leaves MAX_MISSED_PINGS pings in a row unanswered is given up LIVENESS_S after
the last: a client waiting on a dead daemon knows within LIVENESS_S * (MAX_MISSED_PINGS + 1)
= 4.5 s, inside the 5 s promised. Two pings, not one, so that one answer held up by a busy
moment does not fail every request; each has 1.5 s, ages for a front-end, which answers
pings straight from its poll loop.
"""

LIVENESS_S = 1.5
MAX_MISSED_PINGS = 2
MAX_PING_REQUEST_IDS = 4096  # stale requests named in one ping; the rest wait for the next


class Liveness:
    """The ping bookkeeping of one session; it says what to ping, the session sends it."""

    def __init__(self, now_s: float):
        self.heard_s = now_s  # when the front-end last sent this client anything
        self.num_missed_pings = 0
        self._pinged_s = 0.0
        self._pinged_ids: dict[int, list[int]] = {}  # nonce of the last ping -> the request ids it named

    def on_heard(self, now_s: float) -> None:
        self.heard_s, self.num_missed_pings = now_s, 0

    @property
    def is_given_up(self) -> bool:
        return self.num_missed_pings > MAX_MISSED_PINGS

    def due_ping(self, now_s: float, streams: dict, replies: dict) -> list[int] | None:
        """The request ids a ping sent now must name (empty when only a reply is overdue),
        or None when no ping is due. Liveness is judged per request: one that heard nothing
        for LIVENESS_S is named even while other requests' records flow. Check is_given_up
        after a call that returned a list."""
        if now_s - self._pinged_s < LIVENESS_S:
            return None
        stale_ids = [request_id for request_id, stream in streams.items()
                     if not stream.is_done and now_s - stream.heard_s >= LIVENESS_S]
        is_reply_overdue = any(reply is None for reply in replies.values()) and now_s - self.heard_s >= LIVENESS_S
        if not stale_ids and not is_reply_overdue:
            return None
        self.num_missed_pings += 1
        self._pinged_s = now_s
        return stale_ids[:MAX_PING_REQUEST_IDS]

    def on_ping_sent(self, nonce: int, request_ids: list[int]) -> None:
        self._pinged_ids = {nonce: request_ids}  # an older ping's answer no longer matters

    def take_pinged_ids(self, nonce) -> list[int]:
        """The request ids the ping with this nonce named; empty for any other reply."""
        return self._pinged_ids.pop(nonce, [])
