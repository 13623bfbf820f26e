"""Fewer compute threads while other processes take the cores.

llama.cpp's compute threads spin at the barriers between a graph's operations. On a host
whose cores other processes also want, a thread spinning at a barrier keeps a core while the
thread that has the work waits for one, and a step takes many times as long as with a single
thread (docs/operations.md has the figures). The engine reads, every few steps, the share of
their cores the compute threads got inside llama_decode (EngineStats.record_cpu); when the
last NUM_SAMPLES of them average below MIN_SHARE with more than one thread, the governor
drops to one thread, which no barrier can stall. From then on it tries the configured count
again after a probe interval, keeping it when the share holds and dropping back otherwise,
the interval doubling while the host stays busy (FIRST_PROBE_S up to MAX_PROBE_S). A quiet
host never leaves the configured count. Only with `--threads` left to its default: a count
the operator chose is kept.
"""

import math
import time

MIN_SHARE = 0.75  # below this the threads wait for cores more than a spin-free thread would lose
NUM_SAMPLES = 5  # CPU readings (every CPU_TIMED_EVERY_STEPS steps) behind a decision
FIRST_PROBE_S = 10.0
MAX_PROBE_S = 300.0


class ThreadGovernor:
    def __init__(self, max_threads: int, set_threads, log, clock=time.monotonic):
        self.max_threads = self.num_threads = max_threads
        self._set_threads, self._log, self._clock = set_threads, log, clock
        self._shares: list[float] = []  # since the last change of thread count
        self._probe_s = FIRST_PROBE_S
        self._next_probe_at_s = math.inf  # while reduced: when the configured count is tried again
        self._is_probing = False  # the configured count is on trial
        self.num_drops = 0  # times the host's load took the threads down to one

    @property
    def is_reduced(self) -> bool:
        return self.num_threads < self.max_threads

    def on_share(self, share: float) -> None:
        """One reading of the compute threads' share of their cores."""
        self._shares.append(share)
        if len(self._shares) < NUM_SAMPLES:
            return
        mean = sum(self._shares) / len(self._shares)
        self._shares.clear()
        if self.num_threads > 1 and mean < MIN_SHARE:
            self._probe_s = min(2 * self._probe_s, MAX_PROBE_S) if self._is_probing else FIRST_PROBE_S
            self._is_probing = False
            self._change(1)
            self.num_drops += 1
            self._next_probe_at_s = self._clock() + self._probe_s
            self._log(f"compute threads got {100 * mean:.0f}% of their cores (other processes use them): decoding "
                      f"with 1 thread instead of {self.max_threads}, trying {self.max_threads} again in "
                      f"{self._probe_s:.0f} s")
        elif self._is_probing:  # the configured count held its cores: the host is quiet again
            self._is_probing = False
            self._log(f"compute threads got {100 * mean:.0f}% of their cores: decoding with {self.max_threads} "
                      "threads again")

    def on_step(self) -> None:
        """Try the configured count again once its probe is due."""
        if self.is_reduced and self._clock() >= self._next_probe_at_s:
            self._next_probe_at_s = math.inf
            self._is_probing = True
            self._change(self.max_threads)

    def _change(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._shares.clear()
        self._set_threads(num_threads)
