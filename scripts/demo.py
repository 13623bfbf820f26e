"""In-process demo: several prompts decoded together by one engine, printed with figures."""

import argparse
import itertools
import time

from cbatch.config import EngineConfig
from cbatch.params import parse_request
from cbatch.workers.engine import Engine

PROMPTS = [
    {"messages": [{"role": "user", "content": "Write a haiku about autumn rain."}]},
    {"messages": [{"role": "user", "content": "Name three uses of a paperclip."}]},
    {"prompt": "The capital of France is", "stop": ["\n"]},
    {"messages": [{"role": "user", "content": "Explain continuous batching in one sentence."}]},
    {"prompt": "def fibonacci(n):", "temperature": 0},
    {"messages": [{"role": "user", "content": "What is 12 times 12?"}], "temperature": 0},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF path (default: embedded gemma-3-270m)")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    engine = Engine(EngineConfig(model_path=args.model, parallel=args.parallel, ctx_size=1024 * args.parallel))
    ids = itertools.count(1)
    requests = {}
    for body in PROMPTS:
        request = parse_request(next(ids), {"max_tokens": args.max_tokens, **body})
        engine.add_request(request)
        requests[request.request_id] = {"body": body, "text": "", "result": None}
    started = time.perf_counter()
    while engine.has_work:
        for out in engine.step():
            entry = requests[out.request_id]
            entry["text"] += out.text
            if out.finish_reason:
                entry["result"] = out
    elapsed = time.perf_counter() - started
    for entry in requests.values():
        asked = entry["body"].get("prompt") or entry["body"]["messages"][-1]["content"]
        out = entry["result"]
        print(f"### {asked}\n{entry['text'].strip()}\n[{out.finish_reason}, {out.usage['completion_tokens']} tokens]\n")
    stats = engine.stats.snapshot()
    total = sum(e["result"].usage["completion_tokens"] for e in requests.values())
    print(
        f"{len(requests)} requests, parallel {args.parallel}: {total} tokens in {elapsed:.2f} s "
        f"({total / elapsed:.1f} tok/s aggregate); decode {stats['decode_tokens_per_s']:.1f} tok/s, "
        f"prefill {stats['prefill_tokens_per_s']:.1f} tok/s, {stats['avg_concurrent_seqs']:.2f} seqs/step, "
        f"{100 * stats['decode_fraction']:.1f}% of step time in llama_decode"
    )
    engine.close()


if __name__ == "__main__":
    main()
