"""What structured output costs per token against plain decoding, in the engine itself.

First the two ways of enforcing a constraint on one logit row of the model's vocabulary,
side by side: llama.cpp's GBNF sampler (JSON's grammar), which walks the whole vocabulary
for every token of every constrained sequence (the way cbatch enforced constraints
before llguidance), against llguidance's check of the picked token and its mask, which
only a missed check pays. Then the vocabulary adapter's build time, and each schema of
the schema suite's compile time (p50, p99).

Then the engine at each concurrency and each `n` (choices a prompt, so parallel / n
prompts; greedy for n = 1, sampled with a seed a choice otherwise): `json_schema`,
`json_object`, a forced tool call and `json_schema` after a thinking block the prompt
opens (free for a budget of 16 tokens, the schema from its close tag on), each run first;
then plain decoding of exactly as many tokens per sequence (ignore_eos, max_tokens set to
what the constrained sequence produced, the same prompts shared the same way), so both runs
decode the same batch shapes. Printed, a row per round, concurrency, n and mode: tokens,
wall tok/s and plain's, the cost per token against plain (plain tok/s over the mode's),
host ms per step (a step's time outside llama_decode) and plain's, the share of
constrained tokens whose check missed, the answers that stopped (not cut by max_tokens)
and how many of those are `valid`, what was asked (the schema's JSON after the thinking,
an object, a call of the function). No callers: the engine runs in this process, whose
CPU time is printed beside the wall time.

With --compile-delay, last: a daemon on the model, and a small streamed request's time to
first token alone, then submitted just behind a request whose schema is about 100 KB
(a new one each time, so nothing is cached): a row each, and a note of the delay, the
difference of the medians.

    .venv/bin/python scripts/bench.py structured [--model PATH] [--parallel 1 4 16 64] [--n 1 4] [--rounds 2]
        [--compile-delay]
"""

import ctypes
import json
import os
import statistics
import threading
import time

import jsonschema
import llama_cpp
import llama_cpp.llama_cpp as lc
import numpy as np

from benches.options import bench_parser
from benches.peers import CbatchDaemon
from benches.report import Table, note
from benches.schema_suite import suite  # the schemas the tests use too
from cbatch.client import Client
from cbatch.config import EngineConfig
from cbatch.model import resolve_model_path
from cbatch.params import parse_params, parse_request
from cbatch.tools.plan import ToolPlan
from cbatch.workers.engine.engine import Engine
from cbatch.workers.engine.structured.rows import TOKEN_DATA

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 150},
                         "city": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "maxItems": 8, "items": {"type": "string", "maxLength": 20}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOL_PLAN = ToolPlan({"get_weather": {"description": "", "parameters": WEATHER}}, "required", False)
MODES = {
    "json_schema": ("Person {i}, as JSON: ", {"json_schema": PERSON}),
    # a prompt after which the model opens an object (after "as JSON: " gemma writes `{}` and is done)
    "json_object": ("App {i}'s configuration:\n```json\n", {"json_schema": {"type": "object"}}),
    "tool call": ("Call get_weather for city {i}: ", {"tool_call": TOOL_PLAN.constraint()}),
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
        matcher = engine.structured.compiler.matcher(parse_params({"json_schema": {"type": "object"}}))
        note(f"vocabulary adapter built in {engine.structured.compiler.adapter_build_s:.2f} s ({n_vocab} tokens)")
        brace = runner.tokenize("{", add_special=False)[0]
        started = time.perf_counter()
        for _ in range(num_calls):
            matcher.validate_tokens([brace])
        check_ms = (time.perf_counter() - started) / num_calls * 1e3
        rows = engine.structured.rows
        started = time.perf_counter()
        for _ in range(num_calls):
            rows._fill_masks([matcher])
        mask_ms = (time.perf_counter() - started) / num_calls * 1e3
        one_row = Table(f"One logit row of {n_vocab} tokens, constrained", "enforcement", "ms per row",
                        widths={"enforcement": 22})
        one_row.row("llama.cpp GBNF sampler", gbnf_ms)
        one_row.row("llguidance check", check_ms)
        one_row.row("llguidance mask", mask_ms)
        note(f"llguidance's mask, which only a missed check pays, costs {gbnf_ms / mask_ms:.0f}x less than GBNF")
        for schema in suite():
            engine.structured.compiler.matcher(parse_params({"json_schema": schema}))
        compile_ms = sorted(1e3 * s for s in engine.structured.compiler.compile_s)
        p99 = compile_ms[min(len(compile_ms) - 1, int(0.99 * len(compile_ms)))]
        compile_times = Table("Schema compile times", "schemas", "count", "p50 ms", "p99 ms", "max ms",
                              widths={"schemas": 12})
        compile_times.row("schema suite", len(compile_ms), statistics.median(compile_ms), p99, compile_ms[-1])
    finally:
        engine.close()


def run(engine: Engine, bodies: list[dict]) -> tuple[list[dict], float, dict]:
    """({tokens, text, finish} per request, wall seconds, the engine's snapshot delta fields)."""
    before = engine.snapshot()
    ids = []
    for body in bodies:
        request = parse_request(len(ids) + 1 + before["requests_ended"], body)
        engine.add_request(request)
        ids.append(request.request_id)
    answers = {i: {"tokens": 0, "text": "", "finish": ""} for i in ids}
    started = time.perf_counter()
    while engine.has_work:
        for event in engine.step():
            answer = answers[event.request_id]
            answer["tokens"] += len(event.token_ids)
            answer["text"] += event.text
            answer["finish"] = event.finish_reason or answer["finish"]
    wall_s = time.perf_counter() - started
    after = engine.snapshot()
    num_steps = after["num_steps"] - before["num_steps"]
    step_ms_total = after["avg_step_ms"] * after["num_steps"] - before["avg_step_ms"] * before["num_steps"]
    decode_ms_total = (after["decode_fraction"] * after["avg_step_ms"] * after["num_steps"]
                       - before["decode_fraction"] * before["avg_step_ms"] * before["num_steps"])
    checked = after["constrained_tokens"] - before["constrained_tokens"]
    missed = after["constraint_misses"] - before["constraint_misses"]
    return [answers[i] for i in ids], wall_s, {"host_ms": (step_ms_total - decode_ms_total) / max(num_steps, 1),
                                               "miss": missed / checked if checked else 0.0}


def is_valid(mode: str, text: str) -> bool:
    """Whether a stopped answer is what its mode asked for."""
    if mode == "tool call":
        parsed = TOOL_PLAN.parse(text)
        return parsed is not None and parsed[0] is None and len(parsed[1]) == 1
    if mode == "think+schema":
        thinking, close, text = text.partition("</think>")
        if not close:
            return False
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        return False
    if mode == "json_object":
        return isinstance(answer, dict)
    return jsonschema.Draft202012Validator(PERSON).is_valid(answer)


def bodies_of(prompt: str, parallel: int, n: int, fields: dict) -> list[dict]:
    """parallel sequences as parallel / n prompts of n choices each."""
    sampling = {"temperature": 0} if n == 1 else {"temperature": 0.8, "top_p": 0.95}
    return [{"prompt": prompt.format(i=i // n), **sampling, **({"seed": i} if n > 1 else {}), **fields}
            for i in range(parallel)]


def compare(modes: Table, round_number: int, model_path: str, parallel: int, n: int, max_tokens: int) -> None:
    engine = Engine(EngineConfig(model_path=model_path, parallel=parallel, ctx_size=parallel * 1024))
    try:
        engine.structured.tokenizer()  # the adapter, outside the timings
        for mode, (prompt, constraint) in MODES.items():
            bodies = bodies_of(prompt, parallel, n, {"max_tokens": max_tokens, **constraint})
            cpu_started = time.process_time()
            answers, wall_s, figures = run(engine, bodies)
            plain = [{**body, "max_tokens": max(a["tokens"], 1), "ignore_eos": True}
                     for body, a in zip(bodies_of(PLAIN_PROMPT, parallel, n, {}), answers)]
            plain_answers, plain_wall_s, plain_figures = run(engine, plain)
            cpu_s = time.process_time() - cpu_started
            num_tokens = sum(a["tokens"] for a in answers)
            tok_s, plain_tok_s = num_tokens / wall_s, sum(a["tokens"] for a in plain_answers) / plain_wall_s
            stopped = [a for a in answers if a["finish"] == "stop"]
            num_valid = sum(is_valid(mode, a["text"]) for a in stopped)
            modes.row(round_number, parallel, n, mode, num_tokens, tok_s, plain_tok_s, plain_tok_s / tok_s,
                      figures["host_ms"], plain_figures["host_ms"], 100 * figures["miss"], len(stopped), num_valid,
                      cpu_s, wall_s + plain_wall_s)
    finally:
        engine.close()


def big_schema(salt: int, target_bytes: int = 100_000) -> dict:
    """An object schema of about target_bytes of JSON: many optional properties, each an
    object of a few typed fields; salt makes its text new, so no cache answers it."""
    properties = {}
    while len(json.dumps(properties)) < target_bytes:
        k = len(properties)
        properties[f"field_{salt}_{k}"] = {
            "type": "object", "description": f"record {k} of a large form",
            "properties": {"id": {"type": "integer", "minimum": 0}, "label": {"type": "string", "maxLength": 64},
                           "state": {"enum": ["open", "closed", "pending"]},
                           "values": {"type": "array", "items": {"type": "number"}, "maxItems": 8}},
            "required": ["id", "label"], "additionalProperties": False}
    return {"type": "object", "properties": properties, "additionalProperties": False}


def first_token_s(client: Client, i: int) -> float:
    started = time.perf_counter()
    chunks = client.stream(prompt=f"A small request {i}:", max_tokens=4, temperature=0, ignore_eos=True)
    next(chunks)
    first_s = time.perf_counter() - started
    for _ in chunks:
        pass
    return first_s


def compile_delay(model_path: str, num_probes: int) -> None:
    """A small request's first token alone, then just behind a ~100 KB schema's request."""
    daemon = CbatchDaemon(model_path, 2, [])
    try:
        with Client(daemon.endpoint) as client:
            first_token_s(client, -1)  # the first request pays the adapter's build
            idle_s = [first_token_s(client, i) for i in range(num_probes)]
            behind_s, compile_s = [], []
            for i in range(num_probes):
                schema = big_schema(i)
                big_started = time.perf_counter()
                with Client(daemon.endpoint) as big_client:
                    big = threading.Thread(target=lambda: big_client.generate(
                        prompt="Fill the form as JSON: ", max_tokens=1, temperature=0, json_schema=schema))
                    big.start()
                    behind_s.append(first_token_s(client, num_probes + i))
                    big.join()
                compile_s.append(time.perf_counter() - big_started)
        idle, behind = statistics.median(idle_s), statistics.median(behind_s)
        schema_kb = len(json.dumps(big_schema(0))) / 1e3
        first_token = Table(f"A small request's first token, alone and behind a {schema_kb:.0f} KB schema's request",
                            "submitted", "median ms", "max ms", widths={"submitted": 17})
        first_token.row("alone", idle * 1e3, max(idle_s) * 1e3)
        first_token.row("behind the schema", behind * 1e3, max(behind_s) * 1e3)
        note(f"compile delay: {schema_kb:.0f} KB schema answered in {statistics.median(compile_s) * 1e3:.0f} ms "
             f"(median); a small request's first token {(behind - idle) * 1e3:+.1f} ms behind it")
    finally:
        daemon.stop()


def main() -> None:
    parser = bench_parser(__doc__, parallel=[1, 4, 16, 64], max_tokens=48, rounds=2)
    parser.add_argument("--n", type=int, nargs="+", default=[1], help="choices a prompt")
    parser.add_argument("--compile-delay", action="store_true", help="then the ~100 KB schema's delay")
    parser.add_argument("--probes", type=int, default=9, help="small requests timed for --compile-delay")
    parser.add_argument("--calls", type=int, default=50, help="per one-row timing")
    args = parser.parse_args()
    model_path = resolve_model_path(args.model)
    note(f"model {os.path.basename(model_path)}, {os.cpu_count()} CPUs, greedy, max_tokens {args.max_tokens}")
    time_one_row(model_path, args.calls)
    modes = Table("Each mode against plain decoding of as many tokens", "round", "parallel", "n", "mode", "tokens",
                  "tok/s", "plain tok/s", "cost x", "host ms", "plain host ms", "missed %", "stopped", "valid",
                  "CPU s", "wall s", widths={"mode": 12})
    for round_index in range(args.rounds):
        for parallel in args.parallel:
            for n in args.n:
                compare(modes, round_index + 1, model_path, parallel, n, args.max_tokens)
    if args.compile_delay:
        compile_delay(model_path, args.probes)
