"""What per-token log-probabilities cost the decode loop: milliseconds per token over a
full-size (262,144-token, as gemma-3's) logit row, against the plain argmax every greedy
token costs anyway. Only requests that ask for logprobs pay it.

    .venv/bin/python scripts/bench_logprobs.py
"""

import argparse
import time

import numpy as np

from cbatch.workers.logprobs import token_logprobs


def per_call_ms(fn, num_calls: int) -> float:
    started = time.perf_counter()
    for _ in range(num_calls):
        fn()
    return (time.perf_counter() - started) / num_calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    row = np.random.default_rng(0).standard_normal(args.vocab).astype(np.float32) * 4
    argmax_ms = per_call_ms(row.argmax, args.calls)
    print(f"vocabulary {args.vocab}: argmax {argmax_ms:.3f} ms per token")
    for num_top in (0, 1, 5, 20):
        ms = per_call_ms(lambda: token_logprobs(row, 7, num_top, lambda t: b"x"), args.calls)
        print(f"logprobs={num_top:<2}  {ms:.3f} ms per token  ({ms / argmax_ms:.1f}x the argmax)")


if __name__ == "__main__":
    main()
