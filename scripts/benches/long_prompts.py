"""Long prompts, side by side in one run: cbatch in its KV layouts (per-sequence streams,
the default, and one unified pool) with the prefix cache on and off, and llama.cpp's own
llama-server when it is built (scripts/build_llama_server.sh; skipped with a note
otherwise).

Workloads (a closed loop: --clients threads each send --requests requests one after
another; greedy, ignore_eos, so every request generates exactly its max_tokens):
  short   ~25-token prompts, 64 generated
  shared  ~815-token prompts sharing an ~800-token instruction, 16 generated
  unique  ~815-token prompts sharing nothing, 16 generated
  file    cbatch-submit over --file-lines lines sharing a ~1000-token instruction, 16
          generated each (cbatch only; --no-cache-file-lines lines without the cache)
Figures are generated tokens per second of wall time (lines per second for the file): a
row per run as it ends (with cbatch's prefix-cache hit rate), then a table of workloads by
configuration with the ratios of streams to llama-server and to no-cache.
"""

import json
import os
import random
import subprocess
import time

from llama_cpp import Llama

from benches import peers
from benches.callers import closed_loop, counted
from benches.options import bench_parser
from benches.peers import BIN_DIR, CbatchDaemon, LlamaServer
from benches.report import Table, note
from cbatch.model import resolve_model_path

WORDS = ("river stone light garden window paper music winter market engine story number silver forest "
         "question answer morning doctor letter summer island bridge planet coffee village animal ocean").split()
CONFIGS = {  # name -> extra cbatch-worker flags
    "streams": [],  # the default: per-sequence KV streams with the prefix cache
    "streams-no-tier": ["--cache-ram", "0"],  # ... without the host-memory tier below the streams
    "no-cache": ["--no-prefix-cache"],
    "pool": ["--kv-unified"],  # one unified KV pool with the prefix cache
    "pool-no-cache": ["--kv-unified", "--no-prefix-cache"],
}


class Texts:
    """Prompt text cut to a number of the model's tokens."""

    def __init__(self, model_path: str, seed: int = 0):
        self._vocab = Llama(model_path, vocab_only=True, verbose=False)
        self._rng = random.Random(seed)

    def words(self, num_tokens: int) -> str:
        text = " ".join(self._rng.choice(WORDS) for _ in range(num_tokens))
        tokens = self._vocab.tokenize(text.encode(), add_bos=False)[:num_tokens]
        return self._vocab.detokenize(tokens).decode(errors="ignore")


def workload_prompts(texts: Texts, name: str, count: int) -> tuple[list[str], int]:
    if name == "short":
        return [f"Note {i}: " + texts.words(20) for i in range(count)], 64
    if name == "shared":
        instruction = "Read the text and answer the question.\n" + texts.words(790)
        return [f"{instruction}\nQuestion {i}: " + texts.words(12) for i in range(count)], 16
    assert name == "unique"
    return [f"Document {i}.\n" + texts.words(810) for i in range(count)], 16


def run_file(daemon: CbatchDaemon, texts: Texts, num_lines: int) -> float:
    instruction = "Classify the sentiment of the review below as positive or negative.\n" + texts.words(1000)
    path = daemon.workdir / "lines.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"{instruction}\nReview {i}: " + texts.words(12),
                                        "max_tokens": 16, "temperature": 0, "ignore_eos": True}) + "\n"
                            for i in range(num_lines)))
    started = time.perf_counter()
    subprocess.run([str(BIN_DIR / "cbatch-submit"), str(path), "-o", str(daemon.workdir / "out.jsonl")],
                   env=daemon.env, check=True, stderr=subprocess.DEVNULL)
    return num_lines / (time.perf_counter() - started)


def main(argv=None) -> None:
    parser = bench_parser(__doc__, parallel=16, clients=16, requests=(3, "requests per client"))
    parser.add_argument("--workloads", default="short,shared,unique,file")
    parser.add_argument("--configs", default="streams,no-cache,pool,llama-server")
    parser.add_argument("--file-lines", type=int, default=256)
    parser.add_argument("--no-cache-file-lines", type=int, default=64,
                        help="lines of the file without the cache (lines/s is a rate; 256 would take ~6 min)")
    parser.add_argument("--ctx-per-seq", type=int, default=4096)
    args = parser.parse_args(argv)
    model_path = resolve_model_path(args.model)
    texts = Texts(model_path)
    workloads = args.workloads.split(",")
    configs = args.configs.split(",")
    if "llama-server" in configs and not peers.LLAMA_SERVER.exists():
        note(f"{peers.LLAMA_SERVER} is not built (scripts/build_llama_server.sh): llama-server skipped")
        configs.remove("llama-server")
    count = args.clients * args.requests
    prompts = {w: workload_prompts(texts, w, count) for w in workloads if w != "file"}
    rates: dict[tuple[str, str], float] = {}
    runs = Table("runs, as each ends", "config", "workload", "tok/s (file: lines/s)", "cache hit rate",
                 widths={"config": 15})
    for config in configs:
        if config == "llama-server":
            server = LlamaServer(model_path, args.parallel, args.ctx_per_seq, os.cpu_count() or 1)
            try:
                for w, (ps, max_tokens) in prompts.items():
                    rates[w, config] = closed_loop(ps, args.clients, counted(server.send(max_tokens)))[0]
                    runs.row(config, w, rates[w, config], None)
            finally:
                server.stop()
            continue
        for w in workloads:  # a fresh daemon per workload: no workload warms another's cache
            daemon = CbatchDaemon(model_path, args.parallel, CONFIGS[config])
            try:
                if w == "file":
                    num_lines = args.no_cache_file_lines if "no-cache" in config else args.file_lines
                    rates[w, config] = run_file(daemon, texts, num_lines)
                else:
                    ps, max_tokens = prompts[w]
                    rates[w, config] = closed_loop(ps, args.clients, counted(daemon.send(max_tokens)))[0]
                stats = daemon.stats()
            finally:
                daemon.stop()
            if (w, config) in rates:
                runs.row(config, w, rates[w, config], stats["cache_hit_rate"])
    ratios = {"llama-server": "streams/llama-server", "no-cache": "streams/no-cache"}
    ratios = {peer: column for peer, column in ratios.items() if peer in configs}
    summary = Table(f"parallel {args.parallel}, {args.clients} clients x {args.requests} requests, file "
                    f"{args.file_lines} lines ({args.no_cache_file_lines} without the cache); tok/s (file: lines/s)",
                    "workload", *configs, *ratios.values())
    for w in workloads:
        summary.row(w, *(rates.get((w, c)) for c in configs),
                    *(rates[w, "streams"] / rates[w, peer] if (w, "streams") in rates and rates.get((w, peer))
                      else None for peer in ratios))

