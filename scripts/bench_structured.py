"""What structured output costs per token against plain decoding, in the engine itself.

First the two ways of enforcing a constraint on one logit row of the model's vocabulary,
side by side: llama.cpp's GBNF sampler (JSON's grammar), which walks the whole vocabulary
for every token of every constrained sequence (the way cbatch enforced constraints
before llguidance), against llguidance's check of the picked token and its mask, which
only a missed check pays. Then the vocabulary adapter's build time, and each schema of
the schema suite's compile time (p50, p99).

Then the engine at each concurrency: `json_schema`, `json_object`, a forced tool call and
`json_schema` after a thinking block the prompt opens (free for a budget of 16 tokens, the
schema from its close tag on), each run first; then plain decoding of exactly as many tokens per request (ignore_eos,
max_tokens set to what the constrained request produced), so both runs decode the same
batch shapes. Printed per mode: tokens, wall tok/s, the cost per token against plain
(plain tok/s over the mode's), host ms per step (a step's time outside llama_decode), and
the share of constrained tokens whose check missed. No callers: the engine runs in this
process, whose CPU time is printed beside the wall time.

    .venv/bin/python scripts/bench_structured.py [--model PATH] [--parallel 1 4 16 64] [--rounds 2]
"""

import argparse
import ctypes
import os
import statistics
import time

import llama_cpp
import llama_cpp.llama_cpp as lc
import numpy as np
from schema_suite import suite  # this script's folder: the schemas the tests use too

from cbatch.config import EngineConfig
from cbatch.model import resolve_model_path
from cbatch.params import parse_params, parse_request
from cbatch.tools.plan import ToolPlan
from cbatch.workers.engine.engine import Engine
from cbatch.workers.engine.sampling.constrained import TOKEN_DATA

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 150},
                         "city": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "maxItems": 8, "items": {"type": "string", "maxLength": 20}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
MODES = {
    "json_schema": ("Person {i}, as JSON: ", {"json_schema": PERSON}),
    # a prompt after which the model opens an object (after "as JSON: " gemma writes `{}` and is done)
    "json_object": ("App {i}'s configuration:\n```json\n", {"json_schema": {"type": "object"}}),
    "tool call": ("Call get_weather for city {i}: ",
                  {"grammar": ToolPlan({"get_weather": {"description": "", "parameters": WEATHER}}, "required",
                                       False).grammar()}),
    # a thinking block the prompt opens, closed by a budget of 16 tokens, then the schema
    "think+schema": ("Person {i}. Think, then answer as JSON. <think>\n",
                     {"json_schema": PERSON, "reasoning_budget": 16, "reasoning_tags": ["<think>", "</think>"]}),
}
PLAIN_PROMPT = "Write about the weather in city {i}: "


def time_one_row(model_path: str, num_calls: int) -> None:
    """llama.cpp's GBNF sampler on one row against llguidance's check and mask."""
    engine = Engine(EngineConfig(model_path=model_path, parallel=1, ctx_size=1024))
    try:
        runner = engine.runner
        n_vocab = runner.n_vocab
        row = np.random.default_rng(0).standard_normal(n_vocab).astype(np.float32)
        data = np.zeros(n_vocab, TOKEN_DATA)
        grammar = lc.llama_sampler_init_grammar(runner.vocab, llama_cpp.llama_grammar.JSON_GBNF.encode(), b"root")
        array = lc.llama_token_data_array(data.ctypes.data_as(lc.llama_token_data_p), n_vocab, -1, False)
        started = time.perf_counter()
        for _ in range(num_calls):
            data["id"], data["logit"] = np.arange(n_vocab), row
            array.size, array.selected, array.sorted = n_vocab, -1, False
            lc.llama_sampler_apply(grammar, ctypes.byref(array))
        gbnf_ms = (time.perf_counter() - started) / num_calls * 1e3
        lc.llama_sampler_free(grammar)
        matcher = runner.constraints.matcher(parse_params({"json_schema": {"type": "object"}}))
        print(f"vocabulary adapter built in {runner.constraints.adapter_build_s:.2f} s ({n_vocab} tokens)")
        brace = runner.tokenize("{", add_special=False)[0]
        started = time.perf_counter()
        for _ in range(num_calls):
            matcher.validate_tokens([brace])
        check_ms = (time.perf_counter() - started) / num_calls * 1e3
        rows = engine._sampler.constrained
        started = time.perf_counter()
        for _ in range(num_calls):
            rows._fill_masks([matcher])
        mask_ms = (time.perf_counter() - started) / num_calls * 1e3
        print(f"one row: llama.cpp GBNF sampler {gbnf_ms:.3f} ms | llguidance check {check_ms:.4f} ms, "
              f"mask {mask_ms:.3f} ms ({gbnf_ms / mask_ms:.0f}x less than GBNF on a miss)")
        for schema in suite():
            runner.constraints.matcher(parse_params({"json_schema": schema}))
        compile_ms = sorted(1e3 * s for s in runner.constraints.compile_s)
        p99 = compile_ms[min(len(compile_ms) - 1, int(0.99 * len(compile_ms)))]
        print(f"compile: {len(compile_ms)} schemas, p50 {statistics.median(compile_ms):.2f} ms, p99 {p99:.2f} ms, "
              f"max {compile_ms[-1]:.2f} ms")
    finally:
        engine.close()


def run(engine: Engine, bodies: list[dict]) -> tuple[list[int], float, dict]:
    """(tokens per request, wall seconds, the engine's snapshot delta fields)."""
    before = engine.snapshot()
    ids = []
    for body in bodies:
        request = parse_request(len(ids) + 1 + before["requests_ended"], body)
        engine.add_request(request)
        ids.append(request.request_id)
    counts = dict.fromkeys(ids, 0)
    started = time.perf_counter()
    while engine.has_work:
        for event in engine.step():
            counts[event.request_id] += len(event.token_ids)
    wall_s = time.perf_counter() - started
    after = engine.snapshot()
    num_steps = after["num_steps"] - before["num_steps"]
    step_ms_total = after["avg_step_ms"] * after["num_steps"] - before["avg_step_ms"] * before["num_steps"]
    decode_ms_total = (after["decode_fraction"] * after["avg_step_ms"] * after["num_steps"]
                       - before["decode_fraction"] * before["avg_step_ms"] * before["num_steps"])
    checked = after["constrained_tokens"] - before["constrained_tokens"]
    missed = after["constraint_misses"] - before["constraint_misses"]
    return [counts[i] for i in ids], wall_s, {"host_ms": (step_ms_total - decode_ms_total) / max(num_steps, 1),
                                              "miss": missed / checked if checked else 0.0}


def compare(model_path: str, parallel: int, max_tokens: int) -> None:
    engine = Engine(EngineConfig(model_path=model_path, parallel=parallel, ctx_size=parallel * 1024))
    try:
        engine.runner.constraints.tokenizer()  # the adapter, outside the timings
        for mode, (prompt, constraint) in MODES.items():
            bodies = [{"prompt": prompt.format(i=i), "max_tokens": max_tokens, "temperature": 0, **constraint}
                      for i in range(parallel)]
            cpu_started = time.process_time()
            counts, wall_s, figures = run(engine, bodies)
            plain = [{"prompt": PLAIN_PROMPT.format(i=i), "max_tokens": max(n, 1), "temperature": 0, "ignore_eos": True}
                     for i, n in enumerate(counts)]
            plain_counts, plain_wall_s, plain_figures = run(engine, plain)
            cpu_s = time.process_time() - cpu_started
            tok_s, plain_tok_s = sum(counts) / wall_s, sum(plain_counts) / plain_wall_s
            print(f"{parallel:>8} {mode:12} {sum(counts):>6} {tok_s:>8.1f} {plain_tok_s:>8.1f} "
                  f"{plain_tok_s / tok_s:>7.2f}x {figures['host_ms']:>7.2f} {plain_figures['host_ms']:>7.2f} "
                  f"{figures['miss']:>6.1%} {cpu_s:>6.1f} {wall_s + plain_wall_s:>6.1f}")
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF (default: the embedded gemma-3-270m)")
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=50, help="per one-row timing")
    args = parser.parse_args()
    model_path = resolve_model_path(args.model)
    print(f"model {os.path.basename(model_path)}, {os.cpu_count()} CPUs, greedy, max_tokens {args.max_tokens}")
    time_one_row(model_path, args.calls)
    print(f"{'parallel':>8} {'mode':12} {'tokens':>6} {'tok/s':>8} {'plain':>8} {'cost':>8} "
          f"{'host ms':>7} {'plain':>7} {'missed':>6} {'cpu s':>6} {'wall s':>6}")
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}")
        for parallel in args.parallel:
            compare(model_path, parallel, args.max_tokens)


if __name__ == "__main__":
    main()
