"""Engine statistics, timed by the engine itself.

llama.cpp's own perf counters book every multi-token decode as prompt evaluation, so
they cannot tell batched generation from prefill. Here a step that produced at least
one generated token counts as a decode step (a mixed step included); a step of prompt
chunks only counts as prefill.
"""

import time
from dataclasses import dataclass

from cbatch.params import PRIORITIES
from cbatch.workers.engine.sequence import Sequence

MIN_TIMED_DECODE_S = 0.001  # shorter decodes say little about the threads' share (clock granularity)
CPU_TIMED_EVERY_STEPS = 8  # steps between two readings of the process CPU time (Engine.step)
CPU_SHARE_SMOOTHING = 0.2  # weight of one timed step in compute_cpu_share: about the last 5 (40 steps)
STEP_TIME_SMOOTHING = 0.1  # weight of one step in recent_step_s: about the last 10


@dataclass
class EngineStats:
    num_steps: int = 0
    step_s: float = 0.0  # wall time of all steps
    llama_decode_s: float = 0.0  # of which inside llama_decode
    num_decode_steps: int = 0
    decode_steps_s: float = 0.0
    num_generated_tokens: int = 0  # sampled in decode steps: the decode rate's numerator
    # Sampled in any step: also a request's first token when its prefill ended in a step of
    # prompt chunks only (that step's time counts as prefill, its token as generated).
    num_sampled_tokens: int = 0
    seq_decode_steps: int = 0  # sum over decode steps of sequences generating in it
    prefill_steps_s: float = 0.0
    num_prefill_tokens: int = 0  # tokens fed in pure-prefill steps
    num_prompt_tokens_computed: int = 0  # prompt tokens fed in any step (not served by the cache)
    requests_ended: int = 0  # finished for any reason: stop, length, cancelled, error
    recent_step_s: float = 0.0  # the steps' wall time, smoothed: what an embedding decode beside them may take
    # The share of their cores llama.cpp's compute threads got inside llama_decode, over the
    # recent steps (see record_cpu); 1.0 until measured. Its threads spin at their barriers,
    # so they use their cores whole unless other processes take them.
    compute_cpu_share: float = 1.0

    def record_cpu(self, step_cpu_s: float, step_s: float, llama_decode_s: float, num_threads: int) -> float | None:
        """One step without overlap: the process's CPU time in it, less the loop thread's own
        (one core outside llama_decode), is the compute threads'. Returns that share (None
        for a decode too short to say)."""
        if llama_decode_s < MIN_TIMED_DECODE_S:
            return None
        share = min(max((step_cpu_s - (step_s - llama_decode_s)) / (llama_decode_s * num_threads), 0.0), 1.0)
        self.compute_cpu_share += CPU_SHARE_SMOOTHING * (share - self.compute_cpu_share)
        return share

    def record_step(self, step_s: float, llama_decode_s: float, num_batch_tokens: int, num_prompt_tokens: int,
                    num_decode_seqs: int, num_generated: int) -> None:
        self.num_steps += 1
        self.recent_step_s += STEP_TIME_SMOOTHING * (step_s - self.recent_step_s)
        self.num_sampled_tokens += num_generated
        self.num_prompt_tokens_computed += num_prompt_tokens
        self.step_s += step_s
        self.llama_decode_s += llama_decode_s
        if num_decode_seqs:
            self.num_decode_steps += 1
            self.decode_steps_s += step_s
            self.num_generated_tokens += num_generated
            self.seq_decode_steps += num_decode_seqs
        else:
            self.prefill_steps_s += step_s
            self.num_prefill_tokens += num_batch_tokens

    def snapshot(self) -> dict:
        def ratio(a, b):
            return a / b if b else 0.0

        return {
            "decode_tokens_per_s": ratio(self.num_generated_tokens, self.decode_steps_s),
            "prefill_tokens_per_s": ratio(self.num_prefill_tokens, self.prefill_steps_s),
            "avg_concurrent_seqs": ratio(self.seq_decode_steps, self.num_decode_steps),
            "decode_fraction": ratio(self.llama_decode_s, self.step_s),
            "avg_step_ms": 1000 * ratio(self.step_s, self.num_steps),
            "num_steps": self.num_steps,
            "generated_tokens": self.num_sampled_tokens,
            "requests_ended": self.requests_ended,
            "prompt_tokens_computed": self.num_prompt_tokens_computed,
            "compute_cpu_share": self.compute_cpu_share,
        }


def slot_snapshot(seq: Sequence, now_s: float) -> dict:
    """One running request, for `cbatch-status`: where it is and how far it got."""
    return {
        "request_id": seq.request_id,
        "seq_id": seq.seq_id,
        "state": "prefill" if seq.is_prefilling else "decode",
        "priority": PRIORITIES[seq.is_batch],
        "prompt_tokens": seq.num_prompt_tokens,
        "prompt_tokens_done": min(seq.num_cached, seq.num_prompt_tokens),
        "tokens": seq.num_output_tokens,
        "age_s": now_s - seq.arrived_s,
    }


def engine_snapshot(stats: EngineStats, scheduler) -> dict:
    """The engine's statistics, the queue, the KV pool and prefix cache, and one entry per
    running request (`slots`, by sequence id)."""
    kv = scheduler.kv
    now_s = time.monotonic()
    reused, computed = kv.num_tokens_reused, stats.num_prompt_tokens_computed
    return {
        **stats.snapshot(),
        "num_active": len(scheduler.running),
        "num_queued": len(scheduler.waiting),
        "prefix_cache": kv.enable_prefix_cache,
        "prompt_tokens_reused": reused,
        "kv_cache_lookups": kv.num_lookups,
        "kv_cache_device_hits": kv.num_device_hits,
        "cache_hit_rate": reused / (reused + computed) if reused + computed else 0.0,
        "kv_cells_total": kv.num_cells,
        "kv_cells_used": kv.num_cells_used,
        "kv_cells_evictable": kv.num_cells_evictable,
        "cached_prefixes": kv.num_cached_holders,
        "num_preemptions": scheduler.num_preemptions,
        "slots": [slot_snapshot(seq, now_s) for seq in sorted(scheduler.running, key=lambda s: s.seq_id)],
    }
