"""Decides, each step, which sequences hold KV slots and which tokens go into the batch.

Policy: FIFO admission into free slots; every generating sequence gets its one decode
token first, then prefilling sequences share the rest of the step's token budget in
admission order (chunked prefill: a long prompt costs the others at most one chunk
of latency per step, never a stall). No model here: it is tested on its own.
"""

from collections import deque
from dataclasses import dataclass

from cbatch.errors import CbatchError, QUEUE_FULL
from cbatch.workers.sequence import Sequence, SequenceStatus


@dataclass
class Chunk:
    """`num_tokens` tokens of `seq` starting at KV position `start`."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def wants_logits(self) -> bool:
        # Only a chunk that reaches the last known token yields a sample.
        return self.start + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, num_slots: int, max_batch_tokens: int, max_queue: int):
        if max_batch_tokens < num_slots:
            raise ValueError("max_batch_tokens must cover one token per slot")
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._num_admitted = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise CbatchError(
                QUEUE_FULL,
                f"the waiting queue is full ({self.max_queue} requests); retry later or raise --max-queue",
            )
        self.waiting.append(seq)

    def schedule(self) -> list[Chunk]:
        while self.waiting and self._free_slots:
            seq = self.waiting.popleft()
            seq.slot = self._free_slots.pop()
            seq.status = SequenceStatus.RUNNING
            self._num_admitted += 1
            seq.admit_order = self._num_admitted
            self.running.append(seq)

        decoding = [s for s in self.running if not s.is_prefilling]
        chunks = [Chunk(s, s.num_cached, 1) for s in decoding]
        budget = self.max_batch_tokens - len(chunks)
        for seq in self.running:
            if budget == 0:
                break
            if seq.is_prefilling:
                num_tokens = min(seq.num_uncached, budget)
                chunks.append(Chunk(seq, seq.num_cached, num_tokens))
                budget -= num_tokens
        return chunks

    def finish(self, seq: Sequence) -> int | None:
        """Drop a sequence from the queue or the running set; return its freed slot."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.waiting:
            self.waiting.remove(seq)
            return None
        self.running.remove(seq)
        slot, seq.slot = seq.slot, None
        self._free_slots.append(slot)
        return slot

    def preempt_newest(self) -> tuple[Sequence, int]:
        """Send the most recently admitted running sequence back to the head of the
        queue and return it with its freed slot (whose KV the caller must clear); its
        prompt + output so far is recomputed on re-admission."""
        seq = max(self.running, key=lambda s: s.admit_order)
        self.running.remove(seq)
        slot, seq.slot = seq.slot, None
        self._free_slots.append(slot)
        seq.status, seq.num_cached = SequenceStatus.WAITING, 0
        self.waiting.appendleft(seq)
        return seq, slot
