"""The daemon's progress line: one every interval while requests are in flight, none when idle."""

import logging

from cbatch.wording import counted

log = logging.getLogger("cbatch.daemon")


class ProgressLog:
    """Rates are over the interval just ended, from the counters in the worker's stats."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s  # 0 = never
        self._mark: tuple[float, int, int] | None = None  # (time, generated tokens, completed requests)

    def update(self, now_s: float, num_in_flight: int, stats: dict, num_completed: int) -> None:
        if not self.interval_s:
            return
        generated = stats.get("generated_tokens", 0)
        if self._mark is None:
            if num_in_flight:  # busy from now: the first line comes one interval later
                self._mark = (now_s, generated, num_completed)
            return
        marked_s, marked_generated, marked_completed = self._mark
        if now_s - marked_s < self.interval_s:
            return
        elapsed_s = now_s - marked_s
        # A restarted worker counts from zero: what it generated is all this interval's.
        num_generated = generated - marked_generated if generated >= marked_generated else generated
        log.info("%.1f tok/s generated, %s finished in the last %.1f s; %d active, %d queued, %s in flight",
                 num_generated / elapsed_s, counted(num_completed - marked_completed, "request"),
                 elapsed_s, stats.get("num_active", 0), stats.get("num_queued", 0), counted(num_in_flight, "request"))
        self._mark = (now_s, generated, num_completed) if num_in_flight else None
