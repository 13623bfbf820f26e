"""The continuous-batching engine: many requests, one llama.cpp context, one decode per step.

    prepare() -> add() / cancel()  ->  step(): schedule -> llama_decode -> sample -> postprocess
                                       returns SeqOutput events for the caller to publish

`prepare` (tokenize, render chat, compile the grammar) touches no engine state, so the
decode worker runs it off the decode loop's thread. The engine owns no sockets and no
threads; the decode worker drives it with `run_engine_loop`, and tests and the benchmarks
drive it in-process. The runner is handed in, so tests can drive it with a fake one.
"""

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cbatch.config import EngineConfig
from cbatch.errors import CbatchError, PROMPT_TOO_LONG
from cbatch.model import resolve_model_path
from cbatch.params import Request
from cbatch.workers.kv_cache import KVCacheManager
from cbatch.workers.llama_runner import LlamaRunner
from cbatch.workers.sampling import (free_sampler_chain, greedy_rows, make_sampler_chain, needs_host_sampling,
                                    sample_with_chain, suppress_eog)
from cbatch.workers.scheduler import Chunk, Scheduler
from cbatch.workers.sequence import FinishReason, Sequence
from cbatch.workers.stream_cache import StreamCacheManager
from cbatch.workers.logprobs import token_logprobs
from cbatch.workers.stats import EngineStats, slot_snapshot

LLAMA_DECODE_NO_KV_ROOM = 1


@dataclass
class SeqOutput:
    """What one step produced for one request. The last event of a request carries
    `finish_reason` and `usage` (and `error` when the reason is "error")."""

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    logprobs: list | None = None  # one entry per token in token_ids (workers/logprobs.py), if asked for


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
        return Sequence(request.request_id, prompt_ids, request.params, sampler=sampler, is_backend_sampled=on_backend)

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

    def add_request(self, request: Request) -> None:
        self.add(self.prepare(request))

    def cancel(self, request_id: int) -> bool:
        """Mark a request cancelled; it ends at the start of the next step. False if unknown."""
        if request_id not in self._seqs:
            return False
        self._cancel_ids.add(request_id)
        return True

    def step(self) -> list[SeqOutput]:
        started = time.perf_counter()
        outputs = [self._finish(self._seqs[i], FinishReason.CANCELLED) for i in self._cancel_ids]
        self._cancel_ids.clear()
        chunks = self.scheduler.schedule()
        if not chunks:
            return outputs
        chunks, llama_decode_s, status = self._decode(chunks)
        if status != 0:
            message = (
                "the KV cache has no room for this sequence; lower --parallel or raise --ctx-size"
                if status == LLAMA_DECODE_NO_KV_ROOM
                else f"llama_decode failed with status {status}"
            )
            outputs += [self._finish(c.seq, FinishReason.ERROR, message) for c in chunks]
            return outputs
        num_decode_seqs = sum(1 for c in chunks if c.num_tokens == 1 and c.wants_logits)
        num_batch_tokens = sum(c.num_tokens for c in chunks)
        num_prompt_tokens = sum(max(0, min(c.start + c.num_tokens, c.seq.num_prompt_tokens) - c.start) for c in chunks)
        raw_rows = self._rows_before_masking(chunks)
        sampled = self._sample(chunks)
        outputs += self._postprocess(chunks, sampled, self._logprobs(chunks, sampled, raw_rows))
        self.stats.record_step(time.perf_counter() - started, llama_decode_s, num_batch_tokens, num_prompt_tokens,
                               num_decode_seqs, len(sampled))
        return outputs

    def _decode(self, chunks: list[Chunk]) -> tuple[list[Chunk], float, int]:
        """llama_decode; when the KV cache has no room, preempt the newest sequence
        back to the queue and retry with the rest."""
        decode_s = 0.0
        while True:
            self.runner.apply_memory_ops(self.scheduler.kv.take_ops())
            t0 = time.perf_counter()
            status = self.runner.decode(chunks)
            decode_s += time.perf_counter() - t0
            # The KV manager keeps room for every batch, so this is only a safety net.
            if status != LLAMA_DECODE_NO_KV_ROOM or len(self.scheduler.running) < 2:
                return chunks, decode_s, status
            seq = self.scheduler.preempt_newest()
            chunks = [c for c in chunks if c.seq is not seq]
            if not chunks:
                return chunks, decode_s, 0

    def _sample(self, chunks: list[Chunk]) -> list[tuple[Sequence, int]]:
        batch_index, logit_rows = -1, []  # (seq, row in logits, batch index)
        kv = self.scheduler.kv
        for chunk in chunks:
            batch_index += chunk.num_tokens
            chunk.seq.num_cached += chunk.num_tokens
            kv.commit(chunk.seq.seq_id, chunk.seq.token_slice, chunk.seq.num_cached)
            if chunk.wants_logits:
                logit_rows.append((chunk.seq, len(logit_rows), batch_index))
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

    def _rows_before_masking(self, chunks: list[Chunk]) -> dict[int, np.ndarray]:
        """request id -> a copy of its logit row, for the requests that ask for logprobs and
        whose end-of-generation logits _sample() is about to overwrite with -inf (ignore_eos
        when greedy, min_tokens not reached): logprobs are the raw row's."""
        logit_seqs = [chunk.seq for chunk in chunks if chunk.wants_logits]
        masked = [(row, seq) for row, seq in enumerate(logit_seqs) if seq.params.logprobs is not None
                  and (seq.params.ignore_eos if seq.sampler is None else seq.num_output_tokens < seq.params.min_tokens)]
        if not masked:
            return {}
        logits = self.runner.logits(len(logit_seqs))
        return {seq.request_id: logits[row].copy() for row, seq in masked}

    def _logprobs(self, chunks: list[Chunk], sampled: list[tuple[Sequence, int]],
                  raw_rows: dict[int, np.ndarray]) -> dict[int, list]:
        """request id -> the logprobs entry of its sampled token, for the requests that asked."""
        asking = [(seq, token) for seq, token in sampled if seq.params.logprobs is not None]
        if not asking:
            return {}
        logit_seqs = [chunk.seq for chunk in chunks if chunk.wants_logits]
        logits = self.runner.logits(len(logit_seqs))
        row_of = {seq.request_id: row for row, seq in enumerate(logit_seqs)}
        return {seq.request_id: token_logprobs(raw_rows.get(seq.request_id, logits[row_of[seq.request_id]]), token,
                                               seq.params.logprobs, self.runner.token_piece) for seq, token in asking}

    def _postprocess(self, chunks: list[Chunk], sampled: list[tuple[Sequence, int]],
                     logprobs: dict[int, list]) -> list[SeqOutput]:
        outputs = []
        for seq, token in sampled:
            if token in self._eog_set and not seq.params.ignore_eos:
                outputs.append(self._finish(seq, FinishReason.STOP, text=seq.text.finish()))
                continue
            seq.output_ids.append(token)
            text = seq.text.push(self.runner.token_piece(token))
            if seq.text.is_stopped:
                output = self._finish(seq, FinishReason.STOP, token_ids=[token], text=text)
            elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.ctx_per_seq:
                output = self._finish(seq, FinishReason.LENGTH, token_ids=[token], text=text + seq.text.finish())
            else:
                output = SeqOutput(seq.request_id, [token], text)
            if seq.request_id in logprobs:
                output.logprobs = [logprobs[seq.request_id]]
            outputs.append(output)
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
                token_ids: list[int] | None = None, text: str | None = None) -> SeqOutput:
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
        return SeqOutput(seq.request_id, token_ids or [], text, reason.value, usage, error)

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
            "kv_cells_cached": kv.num_cells_evictable,
            "cached_prefixes": kv.num_cached_holders,
            "slots": [slot_snapshot(seq, now_s) for seq in sorted(self.scheduler.running, key=lambda s: s.seq_id)],
        }

    def close(self) -> None:
        for seq in list(self._seqs.values()):
            self._free_sampler(seq)
        self._seqs.clear()
        self.runner.close()


def run_engine_loop(engine: Engine, take_commands: Callable[[bool], bool],
                    publish: Callable[[list[SeqOutput]], None]) -> None:
    """Drive the engine until `take_commands` returns False.

    `take_commands(block)` applies pending add/cancel commands to the engine (waiting
    for one when `block` is true, i.e. the engine is idle) and says whether to go on;
    `publish(outputs)` gets every step's outputs, possibly none.
    """
    while take_commands(not engine.has_work):
        if engine.has_work:
            publish(engine.step())  # even an empty step: publishing is also the liveness beat
