"""What per-token log-probabilities cost: first the computation alone, milliseconds per
token over a full-size (262,144-token, as gemma-3's) logit row against the plain argmax
every greedy token costs anyway; then the whole engine, greedy requests decoded together
with and without `logprobs`, alternating, in one run (asking for logprobs also keeps a
request on the host sampling path and copies its logit row out of llama.cpp's buffer).
Only requests that ask for logprobs pay it. Prints a table of each computation's
milliseconds per token and its ratio to the argmax, then one of the engine's tokens/s and
milliseconds per step without and with logprobs, and the ratio of the two tokens/s.

    .venv/bin/python scripts/bench.py logprobs [--model PATH] [--parallel 16]
"""

import time

import numpy as np

# The engine bench loads llama_cpp before numpy, the order a CUDA build needs (see
# cbatch/__init__.py).
from benches.engine import make_prompts, run_engine
from benches.options import bench_parser
from benches.report import Table, note
from cbatch.config import EngineConfig
from cbatch.model import resolve_model_path
from cbatch.workers.engine.runner import LlamaRunner
from cbatch.workers.engine.sampling.logprobs import token_logprobs


def per_call_ms(fn, num_calls: int) -> float:
    started = time.perf_counter()
    for _ in range(num_calls):
        fn()
    return (time.perf_counter() - started) / num_calls * 1e3


def main() -> None:
    parser = bench_parser(__doc__, model=None, parallel=16, max_tokens=32,
                          rounds=(2, "engine runs without and with logprobs, alternating"))
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--model", default=None, help="GGUF for the engine runs (default: the embedded gemma-3-270m)")
    parser.add_argument("--top", type=int, default=5, help="top_logprobs asked for in the engine runs")
    args = parser.parse_args()
    row = np.random.default_rng(0).standard_normal(args.vocab).astype(np.float32) * 4
    argmax_ms = per_call_ms(row.argmax, args.calls)
    computation = Table(f"One logit row of {args.vocab} tokens", "computation", "ms per token", "x argmax")
    computation.row("argmax", argmax_ms, 1.0)
    for num_top in (0, 1, 5, 20):
        ms = per_call_ms(lambda: token_logprobs(row, 7, num_top, lambda t: b"x"), args.calls)
        computation.row(f"logprobs={num_top}", ms, ms / argmax_ms)
    time_engine(resolve_model_path(args.model), args.parallel, args.max_tokens, args.top, args.rounds)


def time_engine(model_path: str, parallel: int, max_tokens: int, num_top: int, rounds: int) -> None:
    runner = LlamaRunner(EngineConfig(model_path=model_path, parallel=1), model_path)
    try:
        prompts = make_prompts(lambda text: len(runner.tokenize(text)), parallel, 64)
    finally:
        runner.close()
    results: dict[str, list[tuple[float, dict]]] = {"without": [], "with": []}
    for _ in range(rounds):
        for name, extra in (("without", {}), ("with", {"logprobs": num_top})):
            results[name].append(run_engine(model_path, parallel, prompts, {"temperature": 0.0, **extra}, max_tokens))
    engine = Table(f"Engine, {parallel} greedy requests decoded together, {max_tokens} tokens each, mean of {rounds} "
                   "runs", "logprobs", "top", "tok/s", "step ms")
    tok_s = {}
    for name, runs in results.items():
        tok_s[name] = sum(t for t, _ in runs) / len(runs)
        step_ms = sum(stats["avg_step_ms"] for _, stats in runs) / len(runs)
        engine.row(name, num_top if name == "with" else None, tok_s[name], step_ms)
    note(f"engine tok/s with/without logprobs: {tok_s['with'] / tok_s['without']:.3f}")
