"""Engine benchmark: continuous batching vs serving the same prompts one after another.

For each parallel level the in-process engine runs max(parallel, 8) requests (prompts of
about 128 tokens, 64 generated). Prints the setup, then one table: for each mode a row for
llama_cpp.Llama serving the prompts in turn, then a row per parallel level, each with its
aggregate generated tokens/s, the fraction of step time spent inside llama_decode, and the
ratio to serving in turn, measured in the same run.
"""

import argparse
import time

import llama_cpp

from benches.options import bench_parser
from benches.report import Table, note
from cbatch.config import EngineConfig
from cbatch.model import resolve_model_path
from cbatch.params import parse_request
from cbatch.workers.engine.engine import Engine

SENTENCES = [
    "The river carried silt from the mountains down to the wide delta.",
    "Engineers measured the bridge every spring after the floods receded.",
    "A small bakery on the corner sold bread before the sun came up.",
    "Migrating birds rested in the marsh for a few days each autumn.",
    "The library kept its oldest maps in a cool room without windows.",
    "Farmers rotated their crops to keep the soil rich and loose.",
    "At night the harbour lights reflected on the still black water.",
    "The committee argued for hours about the colour of the new trains.",
    "Children collected smooth stones along the shore after the storm.",
    "An old clock in the square had not kept the right time for years.",
]
MODES = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.0, "seed": 1234},
}


def make_prompts(count_tokens, count: int, num_tokens: int) -> list[str]:
    """`count` distinct prompts of at least `num_tokens` tokens each."""
    prompts = []
    for i in range(count):
        words, text = [], ""
        j = i
        while count_tokens(text) < num_tokens:
            words.append(SENTENCES[j % len(SENTENCES)])
            j += 3 + i
            text = f"Story {i}: " + " ".join(words)
        prompts.append(text)
    return prompts


def run_sequential(llm, prompts, params, max_tokens) -> float:
    started, num_generated = time.perf_counter(), 0
    for prompt in prompts:
        out = llm.create_completion(prompt, max_tokens=max_tokens, repeat_penalty=1.0,
                                    **{k: v for k, v in params.items() if k != "min_p"}, min_p=params.get("min_p", 0.0))
        num_generated += out["usage"]["completion_tokens"]
    return num_generated / (time.perf_counter() - started)


def run_engine(model_path, parallel, prompts, params, max_tokens, waves=1, kv_unified=False,
               prefix_cache=True) -> tuple[float, dict]:
    """Run the prompts `waves` times in a row on one engine (later waves reuse the slots)."""
    engine = Engine(EngineConfig(model_path=model_path, parallel=parallel, ctx_size=1024 * parallel,
                                 kv_unified=kv_unified, prefix_cache=prefix_cache))
    try:
        started, num_generated = time.perf_counter(), 0
        for wave in range(waves):
            for i, prompt in enumerate(prompts):
                body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **params}
                engine.add_request(parse_request(wave * len(prompts) + i + 1, body))
            while engine.has_work:
                num_generated += sum(len(out.token_ids) for out in engine.step())
        return num_generated / (time.perf_counter() - started), engine.stats.snapshot()
    finally:
        engine.close()


def main() -> None:
    parser = bench_parser(__doc__, parallel=[1, 2, 4, 8, 16], prompt_tokens=128, max_tokens=64)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--waves", type=int, default=1, help="run each level's prompts this many times in a row")
    parser.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="off: later waves recompute their (identical) prompts")
    args = parser.parse_args()

    model_path = resolve_model_path(args.model)
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=1024, n_batch=512, verbose=False)
    prompts = make_prompts(lambda text: len(llm.tokenize(text.encode())), max(max(args.parallel), 8),
                           args.prompt_tokens)
    note(f"model {model_path}; {len(prompts)} prompts of ~{args.prompt_tokens} tokens, {args.max_tokens} generated "
         f"each; {args.waves} wave(s), {'unified KV' if args.kv_unified else 'one KV stream per slot'}, "
         f"prefix cache {'on' if args.prefix_cache else 'off'}")
    figures = Table("Generated tokens/s, served in turn and batched", "mode", "parallel", "requests", "tok/s",
                    "decode share", "x in turn")
    for mode in args.modes:
        params = MODES[mode]
        sequential = run_sequential(llm, prompts, params, args.max_tokens)
        figures.row(mode, "in turn", len(prompts), sequential, None, 1.0)
        for parallel in args.parallel:
            batch = prompts[: max(parallel, 8)]
            tok_s, stats = run_engine(model_path, parallel, batch, params, args.max_tokens, args.waves, args.kv_unified,
                                      args.prefix_cache)
            figures.row(mode, parallel, len(batch) * args.waves, tok_s, stats["decode_fraction"], tok_s / sequential)
