"""Bare llama_decode cost on this machine: one decode step for 1..16 sequences, and prefill
throughput, through the engine's runner with no scheduling, sampling or sockets. It shows
how much batching can buy before any cbatch code is involved."""

import argparse
import time

from cbatch.config import EngineConfig
from cbatch.model import resolve_model_path
from cbatch.params import SamplingParams
from cbatch.workers.engine.runner import LlamaRunner
from cbatch.workers.engine.scheduler import BatchSpan
from cbatch.workers.engine.sequence import Sequence

PROMPT_TOKENS = 128
NUM_STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    model_path = resolve_model_path(args.model)
    print(f"model {model_path}; {PROMPT_TOKENS}-token prompts, {NUM_STEPS} decode steps")
    print(f"{'sequences':>9} {'prefill tok/s':>13} {'step ms':>8} {'decode tok/s':>12}")
    for parallel in args.parallel:
        runner = LlamaRunner(EngineConfig(model_path=model_path, parallel=parallel, ctx_size=512 * parallel), model_path)
        # Token ids wrap at the vocabulary's size, so a tiny test model runs it too.
        seqs = [Sequence(i, [(1000 + i + k) % runner.n_vocab for k in range(PROMPT_TOKENS)], SamplingParams())
                for i in range(parallel)]
        for seq_id, seq in enumerate(seqs):
            seq.seq_id = seq_id
        started = time.perf_counter()
        for seq in seqs:  # one prompt per decode, as a server would meet them
            assert runner.decode([BatchSpan(seq, 0, PROMPT_TOKENS)]) == 0
            seq.num_cached = PROMPT_TOKENS
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        for step in range(NUM_STEPS):
            for seq in seqs:
                seq.output_ids.append((2000 + step) % runner.n_vocab)
            assert runner.decode([BatchSpan(seq, seq.num_cached, 1) for seq in seqs]) == 0
            for seq in seqs:
                seq.num_cached += 1
        step_s = (time.perf_counter() - started) / NUM_STEPS
        print(f"{parallel:9d} {parallel * PROMPT_TOKENS / prefill_s:13.1f} {1000 * step_s:8.1f} {parallel / step_s:12.1f}",
              flush=True)
        runner.close()


if __name__ == "__main__":
    main()
