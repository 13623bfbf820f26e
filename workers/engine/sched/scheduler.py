"""Decides, each step, which sequences run and which tokens go into the batch.

Policy:
- admission is FIFO within a tenant, the tenants of a priority sharing it by weight
  (fair_share.py; with `fair_share` off, FIFO), every interactive request before any batch one,
  each priority with its own room in the queue (waiting_queue.py), into at most
  `max_running` running sequences, each given a KV sequence id holding its longest
  cached prefix by the KV manager, which reserves cells for the rest of its tokens
  (evicting cached prefixes first) or says there is no room;
- a sequence whose exact prompt a running one computes or has computed forks it instead
  (forks.py): it copies that KV, so a request's `n` choices compute their prompt once;
- fairness: a waiting request is passed over (keeping its place at the head, and a slot
  kept free for it) only while a running sequence is computing the very block of its
  prompt that it would reuse next, and only when the KV manager will really reuse that
  prefix (a stream is copied only for a long enough one), so two requests never prefill
  the same uncached prefix at the same time (forks.is_prefilled_elsewhere); that block is
  done within a step or two, and the request is then admitted before anything behind it;
- every generating sequence gets its one decode token first, then prefilling sequences
  share the rest of the step's token budget, interactive ones first, each priority the
  fewest tokens left first (chunked prefill: a long prompt costs the others at most one span of
  latency per step, never a stall); beside interactive work batch chunks get at most a
  quarter of the step, so an interactive request's first token never waits on a step
  filled with batch prompts;
- a generating sequence whose next cell cannot be had even by eviction preempts the
  newest running batch sequence, or the newest running one when none is batch work, back
  to its priority's resume queue (recomputed on re-admission before later work of that
  priority), its KV dropped: the cells are what is short;
- an interactive request that finds too few free slots takes running batch sequences'
  (preemption.py, unless `preempt_batch` is off): they go back the same way, their KV kept
  in the prefix cache so that resuming costs little;
- a sequence paused for its slow client (set_paused) keeps its slot while nobody waits for
  one; once it has been paused `park_after_s` in all since its admission (a reader that
  takes a little now and then adds up as one that stopped) and requests wait, it is parked:
  it leaves the running set, its KV kept in the prefix cache like a preempted batch
  sequence's, and is requeued behind the other resumed ones of its priority when its client
  catches up. A stalled reader thus costs the others at most one bound of waiting;
- a request past its deadline ends: one still queued leaves the queue in the same one
  pass as cancels (drop_waiting), however many expire at once;
- nothing to do is nothing done: while every running sequence is paused and the queue waits
  for their slots, has_work is False until a command changes that or the next parking or
  deadline is due (the loop then sleeps instead of stepping empty batches).
No model here: it is tested on its own.
"""

import math
import time

from cbatch.workers.engine.kv.base import KVManager
from cbatch.workers.engine.sched.forks import (
    PendingForks,
    can_share_last_row,
    can_share_row,
    find_parent,
    is_prefilled_elsewhere,
)
from cbatch.workers.engine.sched.preemption import choose_batch_victims, num_slots_wanted
from cbatch.workers.engine.sched.step_batch import BatchSpan, prefill_spans, span_order
from cbatch.workers.engine.sched.waiting_queue import DeadlineHeap, WaitingQueue
from cbatch.workers.engine.sequence import SeqStatus, Sequence

# Deadlines handled in one pass at most (a step makes one or two): thousands of requests
# expiring in the same second end over several steps instead of stalling the running
# streams in one.
MAX_EXPIRIES_PER_PASS = 128


class Scheduler:
    def __init__(self, kv: KVManager, max_running: int, max_batch_tokens: int, max_queue: int,
                 max_batch_queue: int, preempt_batch: bool = True, fair_share: bool = True,
                 park_after_s: float = 30.0, clock=time.monotonic):
        if max_batch_tokens < max_running:
            raise ValueError("max_batch_tokens must cover one token per running sequence")
        self.kv = kv
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.waiting = WaitingQueue(max_running, max_queue, max_batch_queue, fair_share)
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.forks = PendingForks()  # admitted, waiting for a running sequence's prompt
        self.row_forks: list[tuple[Sequence, Sequence]] = []  # (parent, fork): see take_row_forks
        self.deadlines = DeadlineHeap()
        # Whether llama.cpp's logits of the last decode are still there when the next batch
        # is scheduled: not with overlap, where the next decode is queued at once.
        self.is_last_row_kept = True
        self.preempt_batch = preempt_batch  # batch sequences give their slots to interactive requests
        self.num_preemptions = 0  # running sequences sent back to the queue, for any reason
        self.park_after_s = park_after_s
        self.parked: list[Sequence] = []  # paused, holding no slot: see set_paused
        self.num_parks = 0  # sequences parked since start
        self.clock = clock
        # While the queue can only wait (no free slot, every running sequence paused): when
        # the next parking or deadline is due. 0.0 once anything changes.
        self._idle_until_s = 0.0
        self._is_short_of_cells = False  # the last admission stopped for want of KV cells

    @property
    def has_work(self) -> bool:
        """Something a step can do: paused sequences alone have nothing to do, nor has a
        queue waiting for their slots before one of them may be parked (the loop then waits
        for a command, such as the one that lets them go on, or for that time)."""
        if len(self.forks) or self.row_forks or any(not seq.is_paused for seq in self.running):
            return True
        return bool(self.waiting) and self.clock() >= self._idle_until_s

    @property
    def idle_wait_s(self) -> float:
        """While has_work is False: how long the loop may wait for a command before a step
        has work again (a parking, or a deadline, is due), or math.inf."""
        return max(0.0, self._idle_until_s - self.clock()) if self.waiting else math.inf

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; QUEUE_FULL (nothing changes) when its priority's room is full."""
        self.waiting.add(seq)
        self.deadlines.add(seq)
        self._idle_until_s = 0.0

    def set_paused(self, seq: Sequence, is_paused: bool) -> None:
        """Its client fell behind (it decodes no more) or caught up; a parked one then goes
        back to the queue, behind the resumed sequences of its priority."""
        seq.set_paused(is_paused, self.clock())
        if not is_paused and seq.status is SeqStatus.PARKED:
            self.parked.remove(seq)
            seq.status = SeqStatus.WAITING
            self.waiting.push_resumed(seq)
            self._idle_until_s = 0.0

    def take_expired(self, now_s: float) -> tuple[list[Sequence], list[Sequence]]:
        """The sequences whose deadline has passed by now_s, at most MAX_EXPIRIES_PER_PASS
        (the rest at the next steps): (those still queued with no output, which leave the
        queue here in one pass; the others, for the caller to finish)."""
        due = self.deadlines.take_due(now_s, MAX_EXPIRIES_PER_PASS)
        queued = [seq for seq in due if seq.status is SeqStatus.WAITING and not seq.output_ids]
        self.drop_waiting(queued)
        return queued, [seq for seq in due if seq.status is not SeqStatus.FINISHED]

    def schedule(self) -> list[BatchSpan]:
        now_s = self.clock()
        self._idle_until_s = 0.0
        if self.waiting:
            self._park_stalled(now_s)
        self._admit()
        running, i = self.running, 0
        while i < len(running):
            seq = running[i]
            # A generating sequence feeds its last sampled token at position num_tokens - 1.
            if seq.status is SeqStatus.DECODING and not seq.is_paused and not self.kv.grow(seq.seq_id, seq.num_tokens):
                victim = self._cells_victim()  # maybe seq itself: the next one is then at i
                i -= running.index(victim) < i  # one before seq: seq moves to i - 1
                self.preempt(victim, keep_cached=False)
                continue
            i += 1
        decoding = SeqStatus.DECODING
        spans = [BatchSpan(s, s.num_cached, 1) for s in running if s.status is decoding and not s.is_paused]
        self.waiting.share.charge_decoded(span.seq for span in spans)
        if len(spans) < len(running):
            spans += prefill_spans(running, self.max_batch_tokens - len(spans), self.max_batch_tokens)
        spans.sort(key=span_order)  # in seq id order: llama.cpp's micro-batches (step_batch.py)
        if (not spans and self.waiting and self.running and not len(self.forks) and not self.row_forks
                and all(seq.is_paused for seq in self.running)):
            self._idle_until_s = self._next_change_s(now_s)
        return spans

    def _park_stalled(self, now_s: float) -> None:
        """Paused sequences past the parking bound give their slots to the waiting requests,
        the longest paused first, as many as those need: a slot each beyond the free ones,
        or one when the last admission found no KV cells (a unified pool that paused
        sequences fill)."""
        stalled = [seq for seq in self.running if seq.is_paused and seq.paused_for_s(now_s) >= self.park_after_s]
        if not stalled:
            return
        num_free = self.max_running - len(self.running) - len(self.forks) - len(self.row_forks)
        num_admissible = sum(not seq.is_paused for seq in self.waiting)  # a paused one is parked, not admitted
        num_wanted = max(num_admissible - num_free, int(self._is_short_of_cells and num_admissible > 0))
        stalled.sort(key=lambda seq: -seq.paused_for_s(now_s))
        for seq in stalled[:num_wanted]:
            self._vacate(seq, keep_cached=True)
            self._park(seq)

    def _park(self, seq: Sequence) -> None:
        seq.status = SeqStatus.PARKED
        self.parked.append(seq)
        self.num_parks += 1

    def _next_change_s(self, now_s: float) -> float:
        """When a queue that can only wait may move: the first paused sequence's parking, or
        the first deadline (which may end a sequence or free its slot)."""
        parkings = (now_s + self.park_after_s - seq.paused_for_s(now_s) for seq in self.running if seq.is_paused)
        return min(min(parkings, default=math.inf), self.deadlines.next_s)

    def row_sharers(self, seq: Sequence) -> list[Sequence]:
        """The forks that sample their first token from `seq`'s logits row of the step that
        computes its last prompt token (asked before on_computed, which forks them)."""
        if not seq.is_prefilling:
            return []
        return [fork for fork in self.forks.of(seq) if can_share_row(seq, fork)]

    def take_row_forks(self) -> list[tuple[Sequence, Sequence]]:
        """(parent, fork) admitted this step to sample from the parent's logits row of the
        last decode; the caller samples each and calls complete_fork. A fork whose parent
        was preempted since goes back to the queue."""
        pairs, self.row_forks = self.row_forks, []
        for parent, fork in pairs:
            if parent.seq_id is None:
                self._requeue(fork)
        return [(parent, fork) for parent, fork in pairs if parent.seq_id is not None]

    def complete_fork(self, parent: Sequence, fork: Sequence, shares_row: bool) -> None:
        self._fork(parent, fork, fork.num_prompt_tokens - (not shares_row))

    def on_computed_batch(self, spans: list[BatchSpan]) -> tuple[list[tuple[Sequence, int, int]], int, tuple]:
        """Count a decoded batch's spans as computed. Returns the (sequence, output row,
        batch index) of each live sequence that samples now, forks sharing their parent's
        row included; the batch's number of output rows; and (batch tokens, prompt tokens,
        decode sequences) for the stats. A sequence that ended while the batch decoded
        (overlap) keeps its output row, so the others' rows stay right, but is skipped."""
        logit_rows, num_outputs, batch_index = [], 0, -1
        num_batch_tokens = num_prompt_tokens = num_decode_seqs = 0
        for span in spans:
            seq, start, num_tokens = span.seq, span.start, span.num_tokens
            batch_index += num_tokens
            num_batch_tokens += num_tokens
            num_prompt_tokens += max(0, min(start + num_tokens, seq.num_prompt_tokens) - start)
            is_sampled = span.wants_logits  # before the span counts as computed
            if seq.status is not SeqStatus.FINISHED:
                sharers = self.row_sharers(seq) if is_sampled else ()
                self.on_computed(span)  # forks the sharers
                if is_sampled:
                    logit_rows.append((seq, num_outputs, batch_index))
                    logit_rows += [(fork, num_outputs, batch_index) for fork in sharers]
            if is_sampled:
                num_outputs += 1
                num_decode_seqs += num_tokens == 1
        return logit_rows, num_outputs, (num_batch_tokens, num_prompt_tokens, num_decode_seqs)

    def on_computed(self, span: BatchSpan) -> None:
        """The step computed the span's tokens: a sequence whose prompt is now computed
        samples from here on, and so do its forks that share its row (row_sharers)."""
        seq = span.seq
        seq.num_cached += span.num_tokens
        self.kv.commit(seq.seq_id, seq.token_slice, seq.num_cached)
        if seq.status is SeqStatus.PREFILLING and span.wants_logits:
            seq.status = SeqStatus.DECODING
            for fork in self.forks.take(seq):
                self._fork(seq, fork, seq.num_prompt_tokens - (not can_share_row(seq, fork)))

    def on_restores_failed(self, failed_ids: list[int], spans: list[BatchSpan]) -> list[BatchSpan]:
        """Sequences whose saved prefix llama.cpp refused at admission (a host tier restore)
        hold nothing: they prefill from their first token, from the next step on. Returns
        the batch without them."""
        failed = [seq for seq in self.running if seq.seq_id in failed_ids]
        for seq in failed:
            self.kv.forget(seq.seq_id)
            self.kv.num_tokens_reused -= seq.num_cached
            seq.num_cached = seq.num_prompt_cached = 0
            seq.status = SeqStatus.PREFILLING if seq.num_uncached > 1 else SeqStatus.DECODING
        return [span for span in spans if span.seq not in failed]

    def finish(self, seq: Sequence, keep_cached: bool) -> None:
        """Drop a sequence from the queue or the running set. A running one's KV stays
        cached for later prompts when `keep_cached` (it is known to be sound)."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.FORKING:
            self.forks.remove(seq)
            self.kv.release(seq.seq_id, seq.token_slice, 0, False)
            seq.seq_id = None
        elif seq.status is SeqStatus.FINISHED:
            return  # already dropped from the queue (drop_waiting)
        elif seq.status is SeqStatus.PARKED:
            self.parked.remove(seq)  # it holds no KV
        else:
            self.running.remove(seq)
            self.kv.release(seq.seq_id, seq.token_slice, seq.num_cached, keep_cached, seq.num_prompt_tokens)
            seq.seq_id = None
            self._requeue_forks(seq)
        self._ended(seq)

    def drop_waiting(self, seqs: list[Sequence]) -> None:
        """Take the waiting ones of seqs out of the queue in one pass (a drain cancels
        thousands at once; one search of the queue per request was quadratic). They are
        FINISHED: finish() then has nothing left to do for them."""
        dropped = {id(seq) for seq in seqs if seq.status is SeqStatus.WAITING}
        if not dropped:
            return
        self.waiting.drop(dropped)
        for seq in seqs:
            if id(seq) in dropped:
                self._ended(seq)

    def _ended(self, seq: Sequence) -> None:
        """The one place a held sequence becomes FINISHED: it frees its place in its
        priority's room and its deadline."""
        seq.status = SeqStatus.FINISHED
        self.waiting.on_ended(seq)
        self.deadlines.discard(seq)
        self._idle_until_s = 0.0

    def preempt_for_cells(self) -> Sequence:
        """Send the lowest-priority running sequence, the most recently admitted among equals,
        back to the head of its priority's queue, its KV dropped (the cells are short): a
        batch one while any runs. Its prompt + output so far is recomputed on re-admission."""
        seq = self._cells_victim()
        self.preempt(seq, keep_cached=False)
        return seq

    def _cells_victim(self) -> Sequence:
        return next((seq for seq in reversed(self.running) if seq.is_batch), self.running[-1])

    def preempt(self, seq: Sequence, keep_cached: bool) -> None:
        """A running sequence back to the head of its priority's queue, keeping its output
        and sampler; with `keep_cached` its computed prefix stays in the prefix cache."""
        self._vacate(seq, keep_cached)
        seq.status = SeqStatus.WAITING
        self.waiting.push_front(seq)
        self.num_preemptions += 1

    def _vacate(self, seq: Sequence, keep_cached: bool) -> None:
        """A running sequence leaves its slot, keeping its output and sampler."""
        self.running.remove(seq)
        self.kv.release(seq.seq_id, seq.token_slice, seq.num_cached, keep_cached, seq.num_prompt_tokens)
        seq.seq_id, seq.num_cached, seq.is_resumed = None, 0, True
        self._requeue_forks(seq)

    def _requeue_forks(self, parent: Sequence) -> None:
        """The parent ended or was preempted before its prompt was computed: its forks go
        back to the head of the queue (the first of them then computes the prompt)."""
        for fork in reversed(self.forks.take(parent)):
            self._requeue(fork)

    def _requeue(self, fork: Sequence) -> None:
        self.kv.release(fork.seq_id, fork.token_slice, 0, False)
        fork.seq_id, fork.num_cached, fork.status, fork.is_resumed = None, 0, SeqStatus.WAITING, True
        self.waiting.push_front(fork)

    def _fork(self, parent: Sequence, fork: Sequence, num_tokens: int) -> None:
        """`fork` (admitted, nothing computed) takes the parent's first `num_tokens`
        positions, which hold its prompt (all of it, or all but the last token)."""
        if num_tokens:
            self.kv.fork(parent.seq_id, fork.seq_id, num_tokens)
        fork.num_cached = num_tokens
        fork.num_prompt_cached = min(num_tokens, fork.num_prompt_tokens)
        fork.status = SeqStatus.DECODING  # at most the last prompt token left to compute
        self.running.append(fork)

    def _start(self, seq: Sequence, parent: Sequence | None) -> int:
        """An admitted sequence runs, or, with a running parent of the same prompt, forks
        it: now, from the parent's last row, or once the parent's prompt is computed (then
        1 is returned: one more fork waits)."""
        if not seq.is_resumed:
            seq.num_prompt_cached = min(seq.num_cached, seq.num_prompt_tokens)
        seq.is_resumed, seq.num_paused_s = False, 0.0  # a new bound of pausing for each admission
        self.waiting.share.on_admitted(seq)
        if parent is None:
            seq.status = SeqStatus.PREFILLING if seq.num_uncached > 1 else SeqStatus.DECODING
            self.running.append(seq)
        elif parent.is_prefilling:
            seq.status = SeqStatus.FORKING
            self.forks.add(parent, seq)
            return 1
        elif self.is_last_row_kept and can_share_last_row(parent, seq):
            seq.status = SeqStatus.FORKING
            self.row_forks.append((parent, seq))
        else:
            self._fork(parent, seq, seq.num_prompt_tokens - 1)
        return 0

    def _admit(self) -> None:
        passed_over = []  # each keeps a slot: later arrivals must not take all of them
        num_forks = len(self.forks)
        if self.preempt_batch and self.waiting.num_interactive:
            num_free = self.max_running - len(self.running) - num_forks - len(self.row_forks)
            for seq in choose_batch_victims(self.running, num_slots_wanted(self.waiting.num_interactive, num_free)):
                self.preempt(seq, keep_cached=True)
        while self.waiting:
            num_taken = len(self.running) + num_forks + len(self.row_forks) + len(passed_over)
            if num_taken >= self.max_running:
                break
            seq = self.waiting.popleft()
            if seq.is_paused:  # preempted while paused: it would hold a slot doing nothing
                self._park(seq)
                continue
            parent = find_parent(seq, self.running) if self.kv.enable_prefix_cache else None
            if parent is None and is_prefilled_elsewhere(seq, self.running, self.kv):
                passed_over.append(seq)
                continue
            placed = self.kv.admit(seq.token_slice, seq.num_tokens, reuse=parent is None)
            self._is_short_of_cells = placed is None
            if placed is None:
                self.waiting.push_front(seq)
                break
            seq.seq_id, seq.num_cached = placed
            num_forks += self._start(seq, parent)
        for seq in reversed(passed_over):
            self.waiting.push_front(seq)
