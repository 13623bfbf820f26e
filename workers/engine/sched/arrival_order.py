"""Admission in arrival order, tenants aside (`cbatch-worker --no-fair-share`).

The same interface as fair_share.py's FairShare and TenantQueues, so the waiting queue
and the scheduler take either: one FIFO per priority, in which a preempted or requeued
sequence goes back to the head, and nothing counted per tenant (the steps then go to
whoever queued first, as many requests as a tenant sends).
"""

from collections import deque

from cbatch.workers.engine.sequence import Sequence


class NoShare:
    """FairShare's calls, none of which keeps anything: no tenant state at all."""

    def __init__(self):
        self.counters: dict[str, float] = {}  # always empty, as FairShare's of an idle daemon

    num_entries = 0

    def hold(self, tenant: str) -> None:
        pass

    def release(self, tenant: str) -> None:
        pass

    def on_queue_empty(self) -> None:
        pass

    def on_admitted(self, seq: Sequence) -> None:
        pass

    def charge_decoded(self, seqs) -> None:
        pass


class ArrivalQueue:
    """One priority's waiting sequences in the order they came."""

    def __init__(self):
        self._fifo: deque[Sequence] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._fifo)

    def __len__(self) -> int:
        return len(self._fifo)

    def __iter__(self):
        return iter(self._fifo)

    def append(self, seq: Sequence) -> None:
        self._fifo.append(seq)

    def appendleft(self, seq: Sequence) -> None:
        self._fifo.appendleft(seq)

    def popleft(self) -> Sequence:
        return self._fifo.popleft()

    def remove(self, seq: Sequence) -> None:
        self._fifo.remove(seq)

    def drop(self, seq_ids: set[int]) -> None:
        """Take the sequences whose id() is in seq_ids out in one pass."""
        self._fifo = deque(seq for seq in self._fifo if id(seq) not in seq_ids)
