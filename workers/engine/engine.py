"""The continuous-batching engine: many requests, one llama.cpp context, one decode per step.

    prepare() -> add() / cancel()  ->  step(): schedule -> llama_decode -> sample -> postprocess
                                       returns the step's TokenEvents for the caller to publish

`prepare` (tokenize, render chat, compile the grammar) touches no engine state, so the
decode worker runs it off the decode loop's thread. The engine owns no sockets and no
threads; the decode worker drives it with `run_engine_loop`, and tests and the benchmarks
drive it in-process. The runner is handed in, so tests can drive it with a fake one.
"""

import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cbatch.config import EngineConfig
from cbatch.errors import CbatchError, PROMPT_TOO_LONG
from cbatch.model import resolve_model_path
from cbatch.ipc.records import TokenEvent
from cbatch.params import BATCH, Request
from cbatch.workers.engine.kv.pool import KVCacheManager
from cbatch.workers.engine.runner import LlamaRunner
from cbatch.workers.engine.sampling.host import (free_sampler_chain, greedy_rows, make_sampler_chain, needs_host_sampling,
                                    sample_with_chain, suppress_eog)
from cbatch.workers.engine.scheduler import BatchSpan, Scheduler
from cbatch.workers.engine.sequence import FinishReason, Sequence, SeqStatus
from cbatch.workers.engine.kv.streams import StreamCacheManager
from cbatch.workers.engine.sampling.logprobs import token_logprobs
from cbatch.workers.engine.stats import EngineStats, slot_snapshot

LLAMA_DECODE_NO_KV_ROOM = 1


class Engine:
    def __init__(self, config: EngineConfig, runner=None):
        self.config = config
        self.runner = runner or LlamaRunner(config, resolve_model_path(config.model_path))
        if config.kv_unified:
            kv = KVCacheManager(self.runner.num_cells, self.runner.num_seq_ids, self.runner.has_prefix_cache,
                                config.max_cached_cells, pin_indexed_cells=self.runner.has_swa)
        else:
            kv = StreamCacheManager(self.runner.num_seq_ids, self.runner.ctx_per_seq, self.runner.has_prefix_cache)
        self.scheduler = Scheduler(kv, config.parallel, config.batch_size, config.max_queue)
        self.stats = EngineStats()
        self._seqs: dict[int, Sequence] = {}
        self._cancel_ids: set[int] = set()
        self._deadlines: list[tuple[float, int]] = []  # a heap of (deadline, request id); stale ids are skipped
        self.expired_while_queued: list[int] = []  # request ids the caller ends with deadline_exceeded
        self._eog_set = frozenset(int(t) for t in self.runner.eog_ids)

    @property
    def ctx_per_seq(self) -> int:
        return self.runner.ctx_per_seq

    @property
    def prefix_cache_note(self) -> str:
        """For the ready line: whether the prefix cache is on, and why not when it is off."""
        if self.scheduler.kv.enable_prefix_cache:
            return "on"
        if self.runner.is_recurrent:
            return "off (recurrent or hybrid model: its memory cannot share part of a sequence)"
        return "off (--no-prefix-cache)"

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def prepare(self, request: Request) -> Sequence:
        """Tokenize a validated request and build its sampler; raises CbatchError if it
        cannot run. Reads only the model, never engine state: safe off the loop thread."""
        text = request.prompt if request.messages is None else self.runner.render_chat(request.messages)
        prompt_ids = self.runner.tokenize(text)
        if len(prompt_ids) >= self.ctx_per_seq:
            raise CbatchError(
                PROMPT_TOO_LONG,
                f"the prompt is {len(prompt_ids)} tokens; a sequence holds {self.ctx_per_seq} "
                "(shorten the prompt or raise --ctx-size)",
            )
        on_backend = self.runner.has_backend_sampling and not needs_host_sampling(request.params)
        sampler = make_sampler_chain(self.runner.vocab, self.runner.eog_ids, request.params, prompt_ids, on_backend)
        deadline_s = time.monotonic() + request.timeout_s if request.timeout_s else math.inf
        return Sequence(request.request_id, prompt_ids, request.params, sampler=sampler, is_backend_sampled=on_backend,
                        is_batch=request.priority == BATCH, deadline_s=deadline_s)

    def add(self, seq: Sequence) -> None:
        """Queue a prepared sequence; on error (a full queue, a taken id) its sampler is freed."""
        try:
            if seq.request_id in self._seqs:
                raise ValueError(f"request id {seq.request_id} is already in use")
            self.scheduler.add(seq)
        except (CbatchError, ValueError):
            free_sampler_chain(seq.sampler)
            raise
        self._seqs[seq.request_id] = seq
        if seq.deadline_s != math.inf:
            heapq.heappush(self._deadlines, (seq.deadline_s, seq.request_id))

    def add_request(self, request: Request) -> None:
        self.add(self.prepare(request))

    def cancel(self, request_id: int) -> bool:
        """Mark a request cancelled; it ends at the start of the next step. False if unknown."""
        if request_id not in self._seqs:
            return False
        self._cancel_ids.add(request_id)
        return True

    def step(self) -> list[TokenEvent]:
        started = time.perf_counter()
        events = [self._finish(self._seqs[i], FinishReason.CANCELLED) for i in self._cancel_ids]
        self._cancel_ids.clear()
        events += self._expire(time.monotonic())
        spans = self.scheduler.schedule()
        if not spans:
            return events
        spans, llama_decode_s, status = self._decode(spans)
        if status != 0:
            message = (
                "the KV cache has no room for this sequence; lower --parallel or raise --ctx-size"
                if status == LLAMA_DECODE_NO_KV_ROOM
                else f"llama_decode failed with status {status}"
            )
            events += [self._finish(c.seq, FinishReason.ERROR, message) for c in spans]
            return events
        num_decode_seqs = sum(1 for c in spans if c.num_tokens == 1 and c.wants_logits)
        num_batch_tokens = sum(c.num_tokens for c in spans)
        num_prompt_tokens = sum(max(0, min(c.start + c.num_tokens, c.seq.num_prompt_tokens) - c.start) for c in spans)
        raw_rows = self._rows_before_masking(spans)
        sampled = self._sample(spans)
        events += self._postprocess(spans, sampled, self._logprobs(spans, sampled, raw_rows))
        self.stats.record_step(time.perf_counter() - started, llama_decode_s, num_batch_tokens, num_prompt_tokens,
                               num_decode_seqs, len(sampled))
        return events

    def _expire(self, now_s: float) -> list[TokenEvent]:
        """Requests whose deadline has passed: one that never ran leaves the queue (named in
        `expired_while_queued`, for the caller to end with an error); one that ran ends
        with `timeout`, keeping what it produced."""
        events = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            _, request_id = heapq.heappop(self._deadlines)
            seq = self._seqs.get(request_id)
            if seq is None:
                continue  # it finished before its deadline
            if seq.status is SeqStatus.WAITING and not seq.output_ids:
                self.scheduler.finish(seq, keep_cached=False)
                self._free_sampler(seq)
                del self._seqs[request_id]
                self.stats.requests_ended += 1
                self.expired_while_queued.append(request_id)
            else:
                events.append(self._finish(seq, FinishReason.TIMEOUT))
        return events

    def _decode(self, spans: list[BatchSpan]) -> tuple[list[BatchSpan], float, int]:
        """llama_decode; when the KV cache has no room, preempt the newest sequence
        back to the queue and retry with the rest."""
        decode_s = 0.0
        while True:
            self.runner.apply_memory_ops(self.scheduler.kv.take_ops())
            t0 = time.perf_counter()
            status = self.runner.decode(spans)
            decode_s += time.perf_counter() - t0
            # The KV manager keeps room for every batch, so this is only a safety net.
            if status != LLAMA_DECODE_NO_KV_ROOM or len(self.scheduler.running) < 2:
                return spans, decode_s, status
            seq = self.scheduler.preempt_newest()
            spans = [c for c in spans if c.seq is not seq]
            if not spans:
                return spans, decode_s, 0

    def _sample(self, spans: list[BatchSpan]) -> list[tuple[Sequence, int]]:
        batch_index, logit_rows = -1, []  # (seq, row in logits, batch index)
        for span in spans:
            batch_index += span.num_tokens
            is_sampled = span.wants_logits  # before the span counts as computed
            self.scheduler.on_computed(span)
            if is_sampled:
                logit_rows.append((span.seq, len(logit_rows), batch_index))
        sampled = [(seq, self.runner.sampled_token(index)) for seq, _, index in logit_rows if seq.is_backend_sampled]
        greedy = [(seq, row) for seq, row, _ in logit_rows if seq.sampler is None and not seq.is_backend_sampled]
        if greedy:
            logits = self.runner.logits(len(logit_rows))
            masked = [row for seq, row in greedy if seq.params.ignore_eos]
            token_ids = greedy_rows(logits, [row for _, row in greedy], masked, self.runner.eog_ids)
            sampled += [(seq, int(t)) for (seq, _), t in zip(greedy, token_ids)]
        for seq, row, index in logit_rows:
            if seq.sampler is not None and not seq.is_backend_sampled:
                if seq.num_output_tokens < seq.params.min_tokens:
                    suppress_eog(self.runner.logits(len(logit_rows)), row, self.runner.eog_ids)
                sampled.append((seq, sample_with_chain(seq.sampler, self.runner.ctx, index)))
        return sampled

    def _rows_before_masking(self, spans: list[BatchSpan]) -> dict[int, np.ndarray]:
        """request id -> a copy of its logit row, for the requests that ask for logprobs and
        whose end-of-generation logits _sample() is about to overwrite with -inf (ignore_eos
        when greedy, min_tokens not reached): logprobs are the raw row's."""
        logit_seqs = [span.seq for span in spans if span.wants_logits]
        masked = [(row, seq) for row, seq in enumerate(logit_seqs) if seq.params.logprobs is not None
                  and (seq.params.ignore_eos if seq.sampler is None else seq.num_output_tokens < seq.params.min_tokens)]
        if not masked:
            return {}
        logits = self.runner.logits(len(logit_seqs))
        return {seq.request_id: logits[row].copy() for row, seq in masked}

    def _logprobs(self, spans: list[BatchSpan], sampled: list[tuple[Sequence, int]],
                  raw_rows: dict[int, np.ndarray]) -> dict[int, list]:
        """request id -> the logprobs entry of its sampled token, for the requests that asked."""
        asking = [(seq, token) for seq, token in sampled if seq.params.logprobs is not None]
        if not asking:
            return {}
        logit_seqs = [span.seq for span in spans if span.wants_logits]
        logits = self.runner.logits(len(logit_seqs))
        row_of = {seq.request_id: row for row, seq in enumerate(logit_seqs)}
        return {seq.request_id: token_logprobs(raw_rows.get(seq.request_id, logits[row_of[seq.request_id]]), token,
                                               seq.params.logprobs, self.runner.token_piece) for seq, token in asking}

    def _postprocess(self, spans: list[BatchSpan], sampled: list[tuple[Sequence, int]],
                     logprobs: dict[int, list]) -> list[TokenEvent]:
        events = []
        for seq, token in sampled:
            if token in self._eog_set and not seq.params.ignore_eos:
                events.append(self._finish(seq, FinishReason.STOP, text=seq.text.finish()))
                continue
            seq.output_ids.append(token)
            text = seq.text.push(self.runner.token_piece(token))
            if seq.text.is_stopped:
                event = self._finish(seq, FinishReason.STOP, token_ids=[token], text=text)
            elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.ctx_per_seq:
                event = self._finish(seq, FinishReason.LENGTH, token_ids=[token], text=text + seq.text.finish())
            else:
                event = TokenEvent(seq.request_id, [token], text)
            if seq.request_id in logprobs:
                event.logprobs = [logprobs[seq.request_id]]
            events.append(event)
        return events

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
                token_ids: list[int] | None = None, text: str | None = None) -> TokenEvent:
        # A failed decode may have left this sequence's cells half written: never reuse them.
        self.scheduler.finish(seq, keep_cached=reason is not FinishReason.ERROR)
        self._free_sampler(seq)
        seq.sampler = None
        del self._seqs[seq.request_id]
        self.stats.requests_ended += 1
        if text is None:
            # A cancelled or failed sequence keeps what it produced: text held back for
            # stop-string matching can no longer become a stop string.
            text = seq.text.finish()
        usage = {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": seq.num_output_tokens}
        return TokenEvent(seq.request_id, token_ids or [], text, reason.value, usage, error)

    def _free_sampler(self, seq: Sequence) -> None:
        if seq.is_backend_sampled:
            self.runner.release_sampler(seq.sampler)  # a chain still attached must not be freed
        free_sampler_chain(seq.sampler)

    def snapshot(self) -> dict:
        """Statistics: the engine's own, the queue, the KV pool and prefix cache, and one
        entry per running request (`slots`, by sequence id)."""
        kv = self.scheduler.kv
        now_s = time.monotonic()
        reused, computed = kv.num_tokens_reused, self.stats.num_prompt_tokens_computed
        return {
            **self.stats.snapshot(),
            "num_active": len(self.scheduler.running),
            "num_queued": len(self.scheduler.waiting),
            "prefix_cache": kv.enable_prefix_cache,
            "prompt_tokens_reused": reused,
            "cache_hit_rate": reused / (reused + computed) if reused + computed else 0.0,
            "kv_cells_total": kv.num_cells,
            "kv_cells_used": kv.num_cells_used,
            "kv_cells_evictable": kv.num_cells_evictable,
            "cached_prefixes": kv.num_cached_holders,
            "slots": [slot_snapshot(seq, now_s) for seq in sorted(self.scheduler.running, key=lambda s: s.seq_id)],
        }

    def close(self) -> None:
        for seq in list(self._seqs.values()):
            self._free_sampler(seq)
        self._seqs.clear()
        self.runner.close()


def run_engine_loop(engine: Engine, apply_pending: Callable[[bool], bool],
                    publish: Callable[[list[TokenEvent]], None]) -> None:
    """Drive the engine until `apply_pending` returns False.

    `apply_pending(wait_for_one)` applies pending add/cancel commands to the engine
    (waiting for one when the engine is idle) and says whether to go on;
    `publish(events)` gets every step's events, possibly none.
    """
    while apply_pending(not engine.has_work):
        if engine.has_work:
            publish(engine.step())  # even an empty step: publishing is also the liveness beat
