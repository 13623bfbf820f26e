"""Bare llama_decode cost on this machine: one decode step for 1..16 sequences, and prefill
throughput, through the engine's runner with no scheduling, sampling or sockets. It shows
how much batching can buy before any cbatch code is involved. Prints the setup, then a row
per number of sequences: prefill tokens/s, a decode step's milliseconds and decode tokens/s."""

import time

from benches.options import bench_parser
from benches.report import Table, note
from cbatch.config import EngineConfig
from cbatch.model import resolve_model_path
from cbatch.params import SamplingParams
from cbatch.workers.engine.runner import LlamaRunner
from cbatch.workers.engine.sched.step_batch import BatchSpan
from cbatch.workers.engine.sequence import Sequence

PROMPT_TOKENS = 128
NUM_STEPS = 20


def bare_decode(model_path: str, parallel: int, prompt_tokens: int = PROMPT_TOKENS, num_steps: int = NUM_STEPS,
                ctx_per_seq: int = 512, threads: int = 0) -> tuple[float, float]:
    """(prefill tok/s, seconds per decode step): `parallel` prompts of `prompt_tokens` tokens
    prefilled one per decode, then `num_steps` steps of one token for each sequence."""
    runner = LlamaRunner(EngineConfig(model_path=model_path, parallel=parallel, ctx_size=ctx_per_seq * parallel,
                                      threads=threads), model_path)
    try:
        # Token ids wrap at the vocabulary's size, so a tiny test model runs it too.
        seqs = [Sequence(i, [(1000 + i + k) % runner.n_vocab for k in range(prompt_tokens)], SamplingParams())
                for i in range(parallel)]
        for seq_id, seq in enumerate(seqs):
            seq.seq_id = seq_id
        started = time.perf_counter()
        for seq in seqs:  # one prompt per decode, as a server would meet them
            assert runner.decode([BatchSpan(seq, 0, prompt_tokens)]) == 0
            seq.num_cached = prompt_tokens
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        for step in range(num_steps):
            for seq in seqs:
                seq.output_ids.append((2000 + step) % runner.n_vocab)
            assert runner.decode([BatchSpan(seq, seq.num_cached, 1) for seq in seqs]) == 0
            for seq in seqs:
                seq.num_cached += 1
        return parallel * prompt_tokens / prefill_s, (time.perf_counter() - started) / num_steps
    finally:
        runner.close()


def main() -> None:
    parser = bench_parser(__doc__, parallel=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    model_path = resolve_model_path(args.model)
    note(f"model {model_path}; {PROMPT_TOKENS}-token prompts, {NUM_STEPS} decode steps")
    figures = Table("Bare llama_decode, by number of sequences", "sequences", "prefill tok/s", "step ms",
                    "decode tok/s")
    for parallel in args.parallel:
        prefill_tps, step_s = bare_decode(model_path, parallel)
        figures.row(parallel, prefill_tps, 1000 * step_s, parallel / step_s)
