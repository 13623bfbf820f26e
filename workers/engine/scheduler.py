"""Decides, each step, which sequences run and which tokens go into the batch.

Policy:
- admission is FIFO within a priority, every interactive request before any batch one
  (the waiting queue holds the interactive ones first), into at most `max_running` running sequences, each given a KV
  sequence id holding its longest cached prefix by the KV manager, which reserves cells
  for the rest of its tokens (evicting cached prefixes first) or says there is no room;
- fairness: a waiting request is passed over (keeping its place at the head, and a slot
  kept free for it) only while a running sequence is computing the very block of its
  prompt that it would reuse next, and only when the KV manager will really reuse that
  prefix (a stream is copied only for a long enough one), so two requests never prefill
  the same uncached prefix at the same time; that block is done within a step or two,
  and the request is then admitted before anything behind it;
- every generating sequence gets its one decode token first, then prefilling sequences
  share the rest of the step's token budget in admission order (chunked prefill: a long
  prompt costs the others at most one span of latency per step, never a stall);
- a generating sequence whose next cell cannot be had even by eviction preempts the
  newest running sequence back to the head of the queue (recomputed on re-admission).
No model here: it is tested on its own.
"""

from collections import deque
from dataclasses import dataclass

from cbatch.errors import CbatchError, QUEUE_FULL
from cbatch.wording import counted
from cbatch.workers.engine.kv.base import BLOCK_TOKENS, KVManager
from cbatch.workers.engine.sequence import SeqStatus, Sequence


@dataclass
class BatchSpan:
    """One sequence's run of tokens in this step's batch: `num_tokens` tokens of `seq` from KV
    position `start` (a prompt chunk, or the one decode token of a generating sequence)."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def wants_logits(self) -> bool:
        # Only a span that reaches the last known token yields a sample.
        return self.start + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, kv: KVManager, max_running: int, max_batch_tokens: int, max_queue: int):
        if max_batch_tokens < max_running:
            raise ValueError("max_batch_tokens must cover one token per running sequence")
        self.kv = kv
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise CbatchError(
                QUEUE_FULL,
                f"the waiting queue is full ({counted(self.max_queue, 'request')}); retry later or raise --max-queue",
            )
        if seq.is_batch:
            self.waiting.append(seq)
            return
        # After the interactive requests already waiting (they lead the queue), before any
        # batch one: a batch file's queue never delays an interactive request's admission.
        position = next((i for i, other in enumerate(self.waiting) if other.is_batch), len(self.waiting))
        self.waiting.insert(position, seq)

    def schedule(self) -> list[BatchSpan]:
        self._admit()
        for seq in list(self.running):
            # A generating sequence feeds its last sampled token at position num_tokens - 1.
            while seq in self.running and not seq.is_prefilling and not self.kv.grow(seq.seq_id, seq.num_tokens):
                self.preempt_newest()
        spans = [BatchSpan(s, s.num_cached, 1) for s in self.running if not s.is_prefilling]
        budget = self.max_batch_tokens - len(spans)
        for seq in self.running:
            if budget == 0:
                break
            if seq.is_prefilling:
                num_tokens = min(seq.num_uncached, budget)
                spans.append(BatchSpan(seq, seq.num_cached, num_tokens))
                budget -= num_tokens
        # The unified pool takes a batch in any order, but with per-sequence streams
        # llama.cpp cuts a batch into one micro-batch per run of consecutive seq ids (and
        # equal token counts): in id order a step stays one or two micro-batches, in
        # admission order it falls apart once reused slots interleave.
        spans.sort(key=lambda c: c.seq.seq_id)
        return spans

    def on_computed(self, span: BatchSpan) -> None:
        """The step computed the span's tokens: a sequence whose prompt is now computed
        samples from here on."""
        seq = span.seq
        seq.num_cached += span.num_tokens
        self.kv.commit(seq.seq_id, seq.token_slice, seq.num_cached)
        if seq.status is SeqStatus.PREFILLING and span.wants_logits:
            seq.status = SeqStatus.DECODING

    def finish(self, seq: Sequence, keep_cached: bool) -> None:
        """Drop a sequence from the queue or the running set. A running one's KV stays
        cached for later prompts when `keep_cached` (it is known to be sound)."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.kv.release(seq.seq_id, seq.token_slice, seq.num_cached, keep_cached)
            seq.seq_id = None
        seq.status = SeqStatus.FINISHED

    def preempt_newest(self) -> Sequence:
        """Send the most recently admitted running sequence back to the head of the queue;
        its prompt + output so far is recomputed on re-admission."""
        seq = self.running.pop()
        self.kv.release(seq.seq_id, seq.token_slice, seq.num_cached, False)
        seq.seq_id, seq.num_cached, seq.status = None, 0, SeqStatus.WAITING
        self.waiting.appendleft(seq)
        return seq

    def _admit(self) -> None:
        passed_over = []  # each keeps a slot: later arrivals must not take all of them
        while self.waiting and len(self.running) + len(passed_over) < self.max_running:
            seq = self.waiting.popleft()
            if self._is_prefilled_elsewhere(seq):
                passed_over.append(seq)
                continue
            placed = self.kv.admit(seq.token_slice, seq.num_tokens)
            if placed is None:
                self.waiting.appendleft(seq)
                break
            seq.seq_id, seq.num_cached = placed
            seq.status = SeqStatus.PREFILLING if seq.num_uncached > 1 else SeqStatus.DECODING
            self.running.append(seq)
        self.waiting.extendleft(reversed(passed_over))

    def _is_prefilled_elsewhere(self, seq: Sequence) -> bool:
        """Is a running sequence computing the next block `seq` could reuse right now?"""
        if not self.kv.enable_prefix_cache:
            return False
        end = self.kv.num_reusable(seq.token_slice, seq.num_tokens) + BLOCK_TOKENS
        if end >= seq.num_tokens:
            return False  # that block holds the last token, which seq computes itself
        prefix = seq.token_slice(0, end)
        return any(other.num_cached < end <= other.num_tokens and other.token_slice(0, end) == prefix
                   and self._num_shared_tokens(seq, other) >= self.kv.min_reuse_tokens for other in self.running)

    @staticmethod
    def _num_shared_tokens(seq: Sequence, other: Sequence) -> int:
        """The whole blocks of seq's tokens (its last token excluded: it is always computed)
        that other's tokens begin with."""
        num_blocks = min(seq.num_tokens - 1, other.num_tokens) // BLOCK_TOKENS
        num_shared = 0
        while num_shared < num_blocks and seq.token_slice(num_shared * BLOCK_TOKENS, (num_shared + 1) * BLOCK_TOKENS) \
                == other.token_slice(num_shared * BLOCK_TOKENS, (num_shared + 1) * BLOCK_TOKENS):
            num_shared += 1
        return num_shared * BLOCK_TOKENS
