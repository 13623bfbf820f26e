"""Fair share of the decode steps among tenants (the API keys' names), within a priority.

Each tenant has a virtual counter: the tokens served to it (each admitted request's
prompt once, then one per generated token) divided by its weight. Among the waiting
requests of one priority, admission takes the head of the tenant whose counter is lowest,
so over time each backlogged tenant gets tokens in proportion to its weight, whatever
the number of requests it queues. Within a tenant, requests keep their FIFO order.

A tenant that becomes active (its first waiting request while it had none) starts at no
less than `virtual_time`, the counter of the tenant admitted last: that tenant had the
lowest counter of those waiting then (start-time fair queuing), so an idle tenant banks
no credit and cannot then hold the steps for as long as it was away. It costs O(1), where
the lowest counter of all tenants with work would cost a pass over them. When nobody waits
any more, nobody is owed anything (the end of a busy period): the virtual time rises to the
highest counter, so every tenant, back or new, starts from the same place.

State per tenant is kept only while it matters: a tenant with nothing queued or running
whose counter is at or below the virtual time would start at the virtual time anyway, so
its counter is dropped then (at once, or as soon as the virtual time passes it). A daemon
that sees many tenants come and go holds counters for those with work, and a few more.

Cost: a tenant's heap entry is its counter when pushed; counters only grow, so an entry
is at most its tenant's counter, and one found stale at the top is pushed again with the
current counter (lazy decrease-key). Admission is O(log T) amortized for T waiting
tenants, and charging a step is one addition per generating sequence.
"""

import heapq
import itertools
import math
from collections import Counter, deque

from cbatch.workers.engine.sequence import Sequence


class FairShare:
    """The tenants' virtual counters, shared by both priorities' queues: a token served is
    one served, at whatever priority."""

    def __init__(self):
        self.counters: dict[str, float] = {}
        self.virtual_time = 0.0
        self.num_held: Counter = Counter()  # sequences added and not ended, by tenant (only tenants with any)
        # (counter, tenant) of tenants that went idle above the virtual time, lowest first;
        # an entry is acted on only if its tenant is still idle when the virtual time passes it.
        self._idle: list[tuple[float, str]] = []

    @property
    def num_entries(self) -> int:
        """Tenant entries held (counters and idle ones): what this state costs."""
        return len(self.counters) + len(self._idle)

    def hold(self, tenant: str) -> None:
        """A sequence of `tenant` was added (it is waiting, then running, until `release`)."""
        self.num_held[tenant] += 1

    def release(self, tenant: str) -> None:
        """A sequence of `tenant` ended; with its last one, the tenant is idle."""
        self.num_held[tenant] -= 1
        if self.num_held[tenant]:
            return
        del self.num_held[tenant]
        if not self.num_held:  # nothing queued or running at all: every tenant starts from the virtual time
            self.counters.clear()
            self._idle.clear()
            return
        counter = self.counters.get(tenant)
        if counter is not None and counter <= self.virtual_time:
            del self.counters[tenant]
        elif counter is not None:
            heapq.heappush(self._idle, (counter, tenant))

    def advance(self, counter: float) -> None:
        """A tenant was admitted at `counter`: the virtual time moves up to it, and the idle
        tenants it passes are forgotten."""
        if counter <= self.virtual_time:
            return
        self.virtual_time = counter
        idle = self._idle
        while idle and idle[0][0] <= counter:
            tenant = heapq.heappop(idle)[1]
            if tenant not in self.num_held and self.counters.get(tenant, math.inf) <= counter:
                del self.counters[tenant]

    def on_queue_empty(self) -> None:
        """Nobody waits: the virtual time rises to the highest counter (O(tenants held),
        paid only when the queue runs dry)."""
        if self.counters:
            self.advance(max(self.counters.values()))

    def activate(self, tenant: str) -> float:
        """`tenant` has work again: its counter, raised to the virtual time."""
        counter = max(self.counters.get(tenant, 0.0), self.virtual_time)
        self.counters[tenant] = counter
        return counter

    def on_admitted(self, seq: Sequence) -> None:
        """The prompt is charged once, at its first admission (a preempted sequence that
        comes back recomputes it at no charge: the preemption was not its doing)."""
        if not seq.is_charged:
            seq.is_charged = True
            self.counters[seq.tenant] = self.counters.get(seq.tenant, 0.0) + seq.num_prompt_tokens / seq.tenant_weight

    def charge_decoded(self, seqs) -> None:
        """One generated token for each of `seqs` (this step's generating sequences)."""
        counters = self.counters
        for seq in seqs:
            counters[seq.tenant] += 1.0 / seq.tenant_weight


class TenantQueues:
    """One priority's waiting sequences: a FIFO per tenant, and a heap of the tenants
    with any, lowest counter first."""

    def __init__(self, share: FairShare):
        self.share = share
        self._fifos: dict[str, deque[Sequence]] = {}  # only tenants with waiting sequences
        self._heap: list[tuple[float, int, str]] = []  # (counter when pushed, tie-break, tenant)
        self._ties = itertools.count()  # equal counters: the tenant that became active first
        self.num_waiting = 0

    def __len__(self) -> int:
        return self.num_waiting

    def __iter__(self):
        for fifo in self._fifos.values():
            yield from fifo

    def _fifo_of(self, tenant: str) -> deque[Sequence]:
        fifo = self._fifos.get(tenant)
        if fifo is None:  # invariant: a tenant has a FIFO here exactly while it has a heap entry
            fifo = self._fifos[tenant] = deque()
            heapq.heappush(self._heap, (self.share.activate(tenant), next(self._ties), tenant))
        elif not fifo:  # its last ones were removed while its heap entry stayed: active again
            self.share.activate(tenant)
        return fifo

    def append(self, seq: Sequence) -> None:
        self._fifo_of(seq.tenant).append(seq)
        self.num_waiting += 1

    def appendleft(self, seq: Sequence) -> None:
        self._fifo_of(seq.tenant).appendleft(seq)
        self.num_waiting += 1

    def popleft(self) -> Sequence:
        """The head of the least-served tenant's FIFO (IndexError when none waits)."""
        heap, counters = self._heap, self.share.counters
        while True:
            counter, tie, tenant = heap[0]
            fifo = self._fifos[tenant]
            if not fifo:  # its sequences were removed: it leaves
                heapq.heappop(heap)
                del self._fifos[tenant]
                continue
            if counter < counters[tenant]:  # charged since it was pushed
                heapq.heapreplace(heap, (counters[tenant], tie, tenant))
                continue
            break
        seq = fifo.popleft()
        self.num_waiting -= 1
        self.share.advance(counter)
        if not fifo:
            heapq.heappop(heap)
            del self._fifos[tenant]
        return seq

    def remove(self, seq: Sequence) -> None:
        """One sequence out (a search of its tenant's FIFO: for one at a time only)."""
        self._fifos[seq.tenant].remove(seq)
        self.num_waiting -= 1

    def drop(self, seq_ids: set[int]) -> None:
        """Take the sequences whose id() is in seq_ids out in one pass."""
        for tenant, fifo in self._fifos.items():
            kept = deque(seq for seq in fifo if id(seq) not in seq_ids)
            self.num_waiting -= len(fifo) - len(kept)
            self._fifos[tenant] = kept
