"""The continuous-batching engine: many requests, one llama.cpp context, one decode per step.

    prepare() -> add() / cancel()  ->  step(): schedule -> llama_decode -> sample -> settle -> text
                                       returns the step's TokenEvents for the caller to publish

Overlap (EngineConfig.overlap; docs/design.md): once step N's ids are settled (end of
generation, max_tokens, cancels), batch N+1 is queued on the runner's decode thread, and
step N's text and publishing run beside it; a sequence a stop string ends at step N has
its row in N+1 skipped, its KV released at once, its sampler freed once N+1 is done.

The engine owns no sockets and no threads but the runner's decode thread; the decode
worker drives it (workers/decode/worker.py), tests and benchmarks drive it in-process.
"""

import logging
import math
import time

from cbatch.config import EngineConfig
from cbatch.errors import INVALID_CONFIG, SHUTDOWN_MESSAGE, SHUTTING_DOWN, CbatchError
from cbatch.ipc.records import TokenEvent
from cbatch.model import resolve_model_path
from cbatch.params import Request
from cbatch.workers.engine.cache_tiers import make_host_tier
from cbatch.workers.engine.image_steps import image_writer
from cbatch.workers.engine.kv.base import KVManager
from cbatch.workers.engine.kv.pool import PoolCacheManager
from cbatch.workers.engine.kv.streams import StreamCacheManager
from cbatch.workers.engine.model_runner import ModelRunner
from cbatch.workers.engine.output import OutputProcessor
from cbatch.workers.engine.preparation import count_prompt_tokens, prepare_sequence
from cbatch.workers.engine.runner import LlamaRunner
from cbatch.workers.engine.sampling.host import free_sampler_chain
from cbatch.workers.engine.sampling.step import StepSampler
from cbatch.workers.engine.sched.scheduler import Scheduler
from cbatch.workers.engine.sched.step_batch import BatchSpan
from cbatch.workers.engine.sequence import FinishReason, SeqStatus, Sequence
from cbatch.workers.engine.stats import CPU_TIMED_EVERY_STEPS, EngineStats, engine_snapshot
from cbatch.workers.engine.structured.manager import StructuredOutput
from cbatch.workers.engine.thinking.tags import model_reasoning
from cbatch.workers.engine.thread_governor import ThreadGovernor

log = logging.getLogger("cbatch.worker")

LLAMA_DECODE_NO_KV_ROOM = 1
NO_KV_ROOM_MESSAGE = "the KV cache has no room for this sequence; lower --parallel or raise --ctx-size"


def make_kv_manager(config: EngineConfig, runner: ModelRunner, host_tier) -> KVManager:
    """The KV layout the config names over the runner's context: one pool of cells shared by
    every sequence (--kv-unified), or a stream per sequence."""
    if not config.kv_unified:
        return StreamCacheManager(runner.num_seq_ids, runner.ctx_per_seq, runner.has_prefix_cache, host_tier)
    kv = PoolCacheManager(runner.num_cells, runner.num_seq_ids, runner.has_prefix_cache, config.max_cached_cells,
                          pin_indexed_cells=runner.has_swa, host=host_tier)
    if kv.pin_indexed_cells and config.parallel > runner.num_seq_ids // 2:
        raise CbatchError(INVALID_CONFIG, f"--parallel {config.parallel} with --kv-unified on a model with "
                          f"sliding-window layers: each running sequence holds two of llama.cpp's "
                          f"{runner.num_seq_ids} KV sequence ids there, so at most {runner.num_seq_ids // 2} run at "
                          f"once; lower --parallel or leave out --kv-unified")
    return kv


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None, mark_sampling=None):
        self.config = config
        self.runner = runner or LlamaRunner(config, resolve_model_path(config.model_path))
        try:  # saved prefix states below the slots (kv/host_tier.py), or None
            self.host_tier = make_host_tier(config, self.runner)
            # A refused layout comes with no host tier (cache_tiers.py): nothing else to stop.
            kv = make_kv_manager(config, self.runner, self.host_tier)
        except CbatchError:
            self.runner.close()
            raise
        self.scheduler = Scheduler(kv, config.parallel, config.batch_size, *config.max_queues, config.preempt_batch,
                                   config.fair_share, config.park_after_s)
        self.stats = EngineStats()
        self.reasoning = model_reasoning(config, self.runner)  # the tags it thinks in, or None
        self._seqs: dict[int, Sequence] = {}
        self._cancel_ids: dict[int, bool] = {}  # request id -> whether the daemon's drain cancels it
        self.expired_while_queued: list[int] = []  # request ids the caller ends with deadline_exceeded
        # Structured output's one owner: preparation compiles with it, the step checks and masks.
        self.structured = StructuredOutput(self.runner.vocab, self.runner.eog_ids, self.runner.n_vocab)
        self._sampler = StepSampler(self.runner, self.structured, mark_sampling)
        self._output = OutputProcessor(self.runner, self._finish)
        # Overlap: queue the next batch before this one's text and publishing (see above).
        self.is_overlapped = config.overlap if config.overlap is not None else self.runner.num_gpu_layers > 0
        self._in_flight: list[BatchSpan] | None = None  # the batch decoding now
        self._status = 0  # llama_decode's status for it, without overlap
        self._decode_s = 0.0  # this step's time in llama_decode (or waiting for it)
        self._step_counts = (0, 0, 0, 0)  # see EngineStats.record_step
        self._deferred_frees: list[Sequence] = []  # ended while their batch decoded
        self.scheduler.is_last_row_kept = not self.is_overlapped
        # The last decode's output rows while llama.cpp still holds them (sched/forks.py).
        self._last_rows: list[tuple[Sequence, int, int]] = []
        self._last_num_outputs = 0
        self._images = image_writer(self.runner, config.batch_size)  # with a projector (--mmproj)
        self.thread_governor = self._thread_governor(config)

    def _thread_governor(self, config: EngineConfig) -> ThreadGovernor | None:
        """Fewer compute threads while other processes take the cores (thread_governor.py):
        on a CPU, with --threads left to its default."""
        is_governed = (not config.threads and not self.is_overlapped and config.num_threads > 1
                       and not self.runner.is_embedding_only and self.runner.num_gpu_layers == 0)
        if not is_governed:
            return None
        return ThreadGovernor(config.num_threads, self.runner.set_threads,
                              lambda message: log.warning("cbatch-worker: %s", message))

    @property
    def ctx_per_seq(self) -> int:
        return self.runner.ctx_per_seq

    @property
    def description(self) -> str:
        """For the ready line and health(): the runner's, and whether decode overlaps publishing."""
        return f"{self.runner.description}, overlap {'on' if self.is_overlapped else 'off'}"

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
        # A cancel counts: it ends a request even when every running one is paused.
        return self.scheduler.has_work or self._in_flight is not None or bool(self._cancel_ids)

    @property
    def idle_wait_s(self) -> float:
        """While has_work is False: how long until a step has work again without a command."""
        return self.scheduler.idle_wait_s

    def prepare(self, request: Request, deadline_s: float = math.inf) -> Sequence:
        """A validated request as a Sequence (preparation.py), its saved prefix read from
        the disk tier into memory where only the disk holds it: safe off the loop thread.
        deadline_s is on the monotonic clock, decided by whoever took the request in."""
        seq = prepare_sequence(self.runner, self.structured, request, self.ctx_per_seq, self.reasoning, deadline_s)
        if self.host_tier is not None:
            self.host_tier.prefetch(seq.prompt_ids)
        return seq

    def count_prompt_tokens(self, request: Request) -> int:
        """The request's prompt tokens, as the model sees it (preparation.py): off the loop thread."""
        return count_prompt_tokens(self.runner, request)

    def add(self, seq: Sequence) -> None:
        """Queue a prepared sequence; on error (a full queue, a taken id) its sampler is freed."""
        try:
            if seq.request_id in self._seqs:
                raise ValueError(f"request id {seq.request_id} is already in use")
            self.scheduler.add(seq)
            # The output length that ends it: max_tokens, or the sequence's context cap.
            seq.max_output_tokens = min(seq.params.max_tokens, self.ctx_per_seq - seq.num_prompt_tokens)
        except (CbatchError, ValueError):
            free_sampler_chain(seq.sampler)
            raise
        self._seqs[seq.request_id] = seq

    def add_request(self, request: Request) -> None:
        """A request taken in here, by a caller running the engine in its own process (no
        front-end): its timeout counts from now."""
        self.add(self.prepare(request, time.monotonic() + request.timeout_s if request.timeout_s else math.inf))

    def cancel(self, request_id: int, is_shutdown: bool = False) -> bool:
        """Mark a request cancelled; it ends at the start of the next step, as `cancelled`,
        or with the error shutting_down when the daemon's drain cancels it. False if unknown."""
        if request_id not in self._seqs:
            return False
        self._cancel_ids[request_id] = self._cancel_ids.get(request_id, False) or is_shutdown
        return True

    def pause(self, request_id: int, is_paused: bool) -> None:
        """Back-pressure from a slow client: a paused request leaves the steps, keeping its
        slot and its KV until requests wait for it past the parking bound, until it is told
        to go on (sched/scheduler.py). Unknown ids are ignored."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.scheduler.set_paused(seq, is_paused)

    def step(self) -> list[TokenEvent]:
        """One step's events; with overlap the next batch decodes while they are published."""
        # Without overlap, every CPU_TIMED_EVERY_STEPS-th step also reads the process's CPU
        # time (a syscall that sums every thread's: tens of µs beside the compute threads).
        is_cpu_timed = not self.is_overlapped and self.stats.num_steps % CPU_TIMED_EVERY_STEPS == 0
        started, cpu_started = time.perf_counter(), time.process_time() if is_cpu_timed else 0.0
        events = []
        if self._in_flight is None:
            events += self._apply_cancels()
            events += self._next_batch()
            if self._in_flight is None:
                return events
        spans, status = self._wait()
        llama_decode_s = self._decode_s
        if status != 0:
            return events + self._fail(spans, status)
        sampled, logprobs = self._sample(spans)
        events += self._apply_cancels()  # with overlap: cancels that came while the batch decoded
        sampled = [(seq, token) for seq, token in sampled if seq.status is not SeqStatus.FINISHED]
        to_text = self._output.settle(sampled, self._sampler.take_dead_ends(), logprobs, events)
        if self.is_overlapped and self.scheduler.has_work:
            events += self._next_batch()  # decodes while the text below is made and the caller publishes
            self.structured.prefetch_masks()  # and while the rows that missed get their next masks
        events += self._output.postprocess(to_text, logprobs)
        step_s = time.perf_counter() - started
        self.stats.record_step(step_s, llama_decode_s, *self._step_counts)
        if is_cpu_timed:  # with overlap the decode runs beside the loop thread's work: never timed
            share = self.stats.record_cpu(time.process_time() - cpu_started, step_s, llama_decode_s,
                                          self.runner.num_threads)
            if share is not None and self.thread_governor is not None:
                self.thread_governor.on_share(share)
        if self.thread_governor is not None:
            self.thread_governor.on_step()
        return events

    def _next_batch(self) -> list[TokenEvent]:
        """Schedule the next batch and launch it. Forks admitted with it whose parent's row
        is in the last decode sample from that row first, before the decode overwrites it:
        their events come first."""
        spans = self.scheduler.schedule()
        events = self._sample_row_forks() if self.scheduler.row_forks else []
        return events + self._launch(spans)

    def _launch(self, spans: list[BatchSpan]) -> list[TokenEvent]:
        """Start decoding the scheduled batch (to completion, without overlap): the KV
        manager's operations, the image chunks' own decode, then llama_decode. Returns the
        events of image chunks that failed."""
        events = []
        spans = self._apply_memory_ops(spans)
        if self._images is not None and self._images.has_chunks(self.scheduler):
            # In a decode of their own before the batch's, which overwrites the last rows.
            self._last_rows = []
            failed = self._images.write(self.scheduler, spans)
            events += [self._finish(seq, FinishReason.ERROR, error) for seq, error in failed]
        self._in_flight = spans or None
        if not spans:
            return events
        t0 = time.perf_counter()
        if self.is_overlapped:
            self.runner.start_decode(spans)  # its status comes with wait_decode()
        else:
            self._last_rows = []  # the decode overwrites llama.cpp's logits
            self._status = self.runner.decode(spans)
        self._decode_s = time.perf_counter() - t0
        return events

    def _apply_memory_ops(self, spans: list[BatchSpan]) -> list[BatchSpan]:
        """The KV manager's operations before the decode; a sequence whose restore failed
        leaves this batch and prefills from its first token (the batch without it is
        returned). Saved states then count in the host tier."""
        failed_ids = self.runner.apply_memory_ops(self.scheduler.kv.take_ops())
        if failed_ids:
            spans = self.scheduler.on_restores_failed(failed_ids, spans)
            self.runner.apply_memory_ops(self.scheduler.kv.take_ops())
        if self.host_tier is not None:
            self.host_tier.settle()
        return spans

    def _sample_row_forks(self) -> list[TokenEvent]:
        """Forks just admitted whose parent sampled its first token in the last decode
        sample theirs from that row, before the next decode overwrites it (sched/forks.py)."""
        row_of = {id(seq): (row, index) for seq, row, index in self._last_rows}
        logit_rows = []
        for parent, fork in self.scheduler.take_row_forks():
            row = row_of.get(id(parent))
            self.scheduler.complete_fork(parent, fork, shares_row=row is not None)
            if row is not None:
                logit_rows.append((fork, *row))
        if not logit_rows:
            return []
        sampled, logprobs = self._sampler.sample(logit_rows, self._last_num_outputs)
        self.stats.num_sampled_tokens += len(sampled)
        events = []
        to_text = self._output.settle(sampled, self._sampler.take_dead_ends(), logprobs, events)
        return events + self._output.postprocess(to_text, logprobs)

    def _wait(self) -> tuple[list[BatchSpan], int]:
        """The batch in flight, decoded; its sequences' deferred sampler frees then run.
        When the KV cache has no room, preempt the newest batch sequence (or the newest)
        back to the queue and retry with the rest (the KV manager keeps room for every
        batch: a safety net)."""
        spans, self._in_flight = self._in_flight, None
        t0 = time.perf_counter()
        status = self.runner.wait_decode() if self.is_overlapped else self._status
        self._decode_s += time.perf_counter() - t0
        for seq in self._deferred_frees:
            self._free_sampler(seq)
        self._deferred_frees.clear()
        while status == LLAMA_DECODE_NO_KV_ROOM and len(self.scheduler.running) >= 2:
            seq = self.scheduler.preempt_for_cells()
            spans = [c for c in spans if c.seq is not seq and c.seq.status is not SeqStatus.FINISHED]
            if not spans:
                return spans, 0
            self._apply_memory_ops(spans)
            t0 = time.perf_counter()
            status = self.runner.decode(spans)
            self._decode_s += time.perf_counter() - t0
        return spans, status

    def _fail(self, spans: list[BatchSpan], status: int) -> list[TokenEvent]:
        message = (NO_KV_ROOM_MESSAGE if status == LLAMA_DECODE_NO_KV_ROOM
                   else f"llama_decode failed with status {status}")
        return [self._finish(c.seq, FinishReason.ERROR,
                             message) for c in spans if c.seq.status is not SeqStatus.FINISHED]

    def _apply_cancels(self) -> list[TokenEvent]:
        """Cancelled requests end, and so do those past their deadline."""
        cancelled = [(self._seqs[i], is_shutdown) for i, is_shutdown in self._cancel_ids.items() if i in self._seqs]
        self._cancel_ids.clear()
        self.scheduler.drop_waiting([seq for seq, _ in cancelled])  # one pass over the queue, not one per request
        events = [self._finish(seq, FinishReason.ERROR, SHUTDOWN_MESSAGE, error_code=SHUTTING_DOWN) if is_shutdown
                  else self._finish(seq, FinishReason.CANCELLED) for seq, is_shutdown in cancelled]
        # Past their deadline: one that never ran leaves the queue, for the caller to end
        # with an error (expired_while_queued); one that ran ends keeping what it produced.
        queued, started = self.scheduler.take_expired(time.monotonic())
        for seq in queued:
            self._finish(seq, FinishReason.TIMEOUT)  # no event: the caller ends it with an error
            self.expired_while_queued.append(seq.request_id)
        return events + [self._finish(seq, FinishReason.TIMEOUT) for seq in started]

    def _sample(self, spans: list[BatchSpan]) -> tuple[list[tuple[Sequence, int]], dict[int, list]]:
        """Count the batch's spans as computed and sample the sequences that reached their
        last token (and the forks that share their rows)."""
        logit_rows, num_outputs, counts = self.scheduler.on_computed_batch(spans)
        sampled, logprobs = self._sampler.sample(logit_rows, num_outputs)
        if self.scheduler.is_last_row_kept:
            self._last_rows, self._last_num_outputs = logit_rows, num_outputs
        self._step_counts = (*counts, len(sampled))
        return sampled, logprobs

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
                token_ids: list[int] | None = None, text: str | None = None, error_code: str = "") -> TokenEvent:
        # A failed decode may have left this sequence's cells half written: never reuse them.
        self.scheduler.finish(seq, keep_cached=reason is not FinishReason.ERROR)
        if self._in_flight is not None:  # its chain may be in the decoding batch's graph
            self._deferred_frees.append(seq)
        else:
            self._free_sampler(seq)
        del self._seqs[seq.request_id]
        self.stats.requests_ended += 1
        if text is None:
            # A cancelled or failed sequence keeps what it produced: text held back for
            # stop-string matching can no longer become a stop string.
            text = seq.text.finish()
        usage = {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": seq.num_output_tokens,
                 "cached_tokens": seq.num_prompt_cached}
        return TokenEvent(seq.request_id, token_ids or [], text, reason.value, usage, error, error_code=error_code,
                          stop_string=seq.text.stop_string)

    def _free_sampler(self, seq: Sequence) -> None:
        if seq.is_backend_sampled:
            self.runner.release_sampler(seq.sampler)  # a chain still attached must not be freed
        free_sampler_chain(seq.sampler)
        seq.sampler = None

    def snapshot(self) -> dict:
        """Statistics: the engine's own, the queue, the KV pool and prefix cache, one entry
        per running request (`slots`, by sequence id), the constrained tokens checked and of
        those the ones that missed (each cost a mask), the vision encoder's runs, and the
        running requests paused for a slow client."""
        num_checked, num_missed = self.structured.counts
        vision = self.runner.vision
        tiers = self.host_tier.snapshot() if self.host_tier is not None else {}
        return {**engine_snapshot(self.stats, self.scheduler), **tiers, "constrained_tokens": num_checked,
                "constraint_misses": num_missed, "num_images_encoded": vision.num_encoded if vision else 0,
                "num_paused": sum(seq.is_paused for seq in self.scheduler.running),
                "num_parked": len(self.scheduler.parked), "num_parks": self.scheduler.num_parks,
                "compute_threads": self.runner.num_threads, "compute_threads_max": self.config.num_threads}

    def close(self) -> None:
        if self._in_flight is not None:
            self._wait()
        if self.host_tier is not None:
            if self.host_tier.disk is not None:  # what the streams hold outlives the daemon too
                self.scheduler.kv.spill_all()
                self._apply_memory_ops([])
            self.host_tier.close()
        for seq in list(self._seqs.values()):
            self._free_sampler(seq)
        self._seqs.clear()
        if self._images is not None:
            self._images.close()
        self.runner.close()

