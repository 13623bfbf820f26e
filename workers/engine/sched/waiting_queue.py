"""What the scheduler holds besides its running set: the waiting requests, each priority's
room, and the deadlines.

WaitingQueue:
- one queue per priority; `popleft` takes an interactive request while any waits, so every
  interactive request is admitted before any batch one. Within a priority the tenants share
  admission by weight (fair_share.py), each tenant's requests in FIFO order, or with fair
  share off all in arrival order (arrival_order.py). A preempted or requeued sequence goes
  back to the head of its tenant's FIFO in its own priority;
- each priority has its own room: it may hold `max_running` plus its own queue limit
  (--max-queue for interactive requests, --max-batch-queue for batch ones) in the engine,
  waiting and running together, as the front-end counts its requests in flight. A batch
  load that fills its room therefore never makes an interactive request see queue_full,
  and a burst of slots + queue limit reaching an idle worker between two steps fits.

DeadlineHeap: the deadlines of the live sequences, soonest first, holding only
(deadline_s, request_id) per entry, so a finished request costs nothing once it ends.
No model here: the scheduler drives both.
"""

import heapq
import math
from collections import deque

from cbatch.config import QUEUE_FLAGS
from cbatch.errors import QUEUE_FULL, CbatchError
from cbatch.params import PRIORITIES
from cbatch.wording import counted
from cbatch.workers.engine.sched.arrival_order import ArrivalQueue, NoShare
from cbatch.workers.engine.sched.fair_share import FairShare, TenantQueues
from cbatch.workers.engine.sequence import Sequence

# Entries of ended sequences the deadline heap may hold beyond its live ones before it is
# rebuilt: small enough to be nothing in memory, large enough that rebuilds are rare.
MIN_STALE_DEADLINES = 1024


class WaitingQueue:
    def __init__(self, max_running: int, max_queue: int, max_batch_queue: int, fair_share: bool = True):
        self.share = FairShare() if fair_share else NoShare()
        make_queue = (lambda: TenantQueues(self.share)) if fair_share else ArrivalQueue
        self._queues = (make_queue(), make_queue())  # by is_batch
        self._resumed: tuple[deque[Sequence], deque[Sequence]] = (deque(), deque())  # by is_batch
        self.max_queues = (max_queue, max_batch_queue)
        self._max_held = (max_running + max_queue, max_running + max_batch_queue)
        # Per priority: the sequences added and not yet ended (waiting, running or forking).
        self._num_held = [0, 0]

    def __len__(self) -> int:
        return self._num_waiting(False) + self._num_waiting(True)

    def _num_waiting(self, is_batch: bool) -> int:
        return len(self._resumed[is_batch]) + self._queues[is_batch].num_waiting

    @property
    def num_interactive(self) -> int:
        return self._num_waiting(False)

    def __iter__(self):
        """The interactive ones, then the batch ones (the resumed first, then each tenant's in
        admission order)."""
        for is_batch in (False, True):
            yield from self._resumed[is_batch]
            yield from self._queues[is_batch]

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the tail of its priority, or refuse it with QUEUE_FULL
        when its priority's room is full (nothing changes then)."""
        is_batch = seq.is_batch
        if self._num_held[is_batch] >= self._max_held[is_batch]:
            raise CbatchError(
                QUEUE_FULL,
                f"the {PRIORITIES[is_batch]} queue is full ({counted(self.max_queues[is_batch], 'request')} "
                f"waiting beyond the running ones); retry later or raise {QUEUE_FLAGS[is_batch]}",
            )
        self._num_held[is_batch] += 1
        self.share.hold(seq.tenant)
        self._queues[is_batch].append(seq)

    def on_ended(self, seq: Sequence) -> None:
        """`seq`, added once, ended (wherever it was): its place in its room is free.
        Called exactly once per added sequence."""
        self._num_held[seq.is_batch] -= 1
        self.share.release(seq.tenant)

    def popleft(self) -> Sequence:
        is_batch = not self._num_waiting(False)
        resumed = self._resumed[is_batch]
        seq = resumed.popleft() if resumed else self._queues[is_batch].popleft()
        if not len(self):
            self.share.on_queue_empty()
        return seq

    def push_front(self, seq: Sequence) -> None:
        """Back to the head of its priority (preempted, requeued, or not admitted now): of the
        resume queue when it was admitted before (`is_resumed`), else of its tenant's FIFO."""
        if seq.is_resumed:
            self._resumed[seq.is_batch].appendleft(seq)
        else:
            self._queues[seq.is_batch].appendleft(seq)

    def push_resumed(self, seq: Sequence) -> None:
        """To the tail of its priority's resume queue: a parked sequence whose client caught
        up goes before new requests but after those preempted before it came back."""
        self._resumed[seq.is_batch].append(seq)

    def remove(self, seq: Sequence) -> None:
        """One sequence out of the queue (a search of its FIFO: for one at a time only)."""
        resumed = self._resumed[seq.is_batch]
        if seq in resumed:
            resumed.remove(seq)
        else:
            self._queues[seq.is_batch].remove(seq)

    def drop(self, seq_ids: set[int]) -> None:
        """Take the sequences whose id() is in seq_ids out of the queue in one pass."""
        for resumed, queue in zip(self._resumed, self._queues):
            if resumed:
                kept = [seq for seq in resumed if id(seq) not in seq_ids]
                resumed.clear()
                resumed.extend(kept)
            if queue.num_waiting:
                queue.drop(seq_ids)


class DeadlineHeap:
    """The live sequences that have a deadline, soonest first. The heap holds (deadline_s,
    request_id); the sequences themselves are found by id in `_live`, which a sequence
    leaves as it ends (discard). Its heap entry, now stale, is skipped when it surfaces,
    and the stale entries are dropped all at once when they outnumber the live ones by
    MIN_STALE_DEADLINES: the heap holds at most 2 x live + MIN_STALE_DEADLINES entries,
    and each rebuild is paid for by the ends that made its stale entries (amortized O(1)
    per end). An entry is live only while `_live` holds a sequence of its id with its
    deadline: a request id used again later is a new entry."""

    def __init__(self):
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, Sequence] = {}

    @property
    def num_entries(self) -> int:
        """Heap entries, stale ones included (what the heap costs in memory)."""
        return len(self._heap)

    def add(self, seq: Sequence) -> None:
        if seq.deadline_s != math.inf:
            heapq.heappush(self._heap, (seq.deadline_s, seq.request_id))
            self._live[seq.request_id] = seq

    def discard(self, seq: Sequence) -> None:
        """`seq` ended: its deadline no longer matters."""
        if self._live.get(seq.request_id) is not seq:
            return  # it had no deadline, or it was taken as due
        del self._live[seq.request_id]
        if len(self._heap) > 2 * len(self._live) + MIN_STALE_DEADLINES:
            self._heap = [entry for entry in self._heap if self._is_live(entry)]
            heapq.heapify(self._heap)

    @property
    def next_s(self) -> float:
        """The soonest deadline, or one that has ended since (inf: none)."""
        return self._heap[0][0] if self._heap else math.inf

    def take_due(self, now_s: float, max_count: int) -> list[Sequence]:
        """The live sequences whose deadline is at or before now_s, soonest first and at
        most max_count of them, which leave the heap."""
        due = []
        while self._heap and self._heap[0][0] <= now_s and len(due) < max_count:
            entry = heapq.heappop(self._heap)
            if self._is_live(entry):
                due.append(self._live.pop(entry[1]))
        return due

    def _is_live(self, entry: tuple[float, int]) -> bool:
        seq = self._live.get(entry[1])
        return seq is not None and seq.deadline_s == entry[0]
