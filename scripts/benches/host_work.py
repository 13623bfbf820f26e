"""Host work per decode step: the stand-in for a GPU, where llama_decode takes a few ms.

Writes a random-weight model with a full-size vocabulary (262,144 tokens, as gemma's) and
a tiny body (scripts/make_tiny_model.py), runs the real engine on it at each parallel
level, greedy and sampled, and prints a table row per run: the ms per decode step spent
outside llama_decode, split by phase, their total, llama_decode's and the whole step's:

    schedule+fill  scheduling, KV bookkeeping and filling the llama_batch
    logits         reading what the step produced: the logit rows (or the sampled ids)
    sample         argmax or the sampler chains, accepting tokens
    text           finish checks on token ids, token pieces, stop strings
    publish        ring writes, the tick and the events message, as the decode worker does

The engine is not changed for this: its methods and llama_decode are wrapped with timers
in this process only. Only steps where every sequence generates are counted.

Each level runs with sampling on the host ("off": the logit rows come back, argmax or
chains run in Python's process) and inside llama_decode's graph ("on": token ids come
back), side by side in one run.

Usage: .venv/bin/python scripts/bench.py host_work [--parallel 16 64] [--steps 32] [--backend-sampling off on]
       [--vocab N] [--clock wall|thread]
"""

import os
import tempfile
import time

import llama_cpp.llama_cpp as lc
import zmq
from tiny_models.llama import make_tiny_model  # scripts/, the entry's folder

from benches.options import bench_parser
from benches.report import Table, note
from cbatch.config import EngineConfig
from cbatch.ipc.ring import create_ring
from cbatch.params import parse_request
from cbatch.workers.decode import publisher as publisher_module
from cbatch.workers.decode.publisher import EventPublisher
from cbatch.workers.engine.embedder import Embedder
from cbatch.workers.engine.engine import Engine
from cbatch.workers.messages import encode

FULL_VOCAB_TOKENS = 262_144
PROMPT = "The river carried silt from the mountains down to the wide delta."
RING_CAPACITY_RECORDS = 1 << 16
MODES = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 1234},
}
PHASES = ("schedule+fill", "logits", "sample", "text", "publish")


class Timers:
    """Accumulated nanoseconds per name; `wrap` times every call of a callable, by the wall
    clock or by the calling thread's CPU time (which leaves out the time other processes
    of a shared machine had the core)."""

    def __init__(self, clock=time.perf_counter_ns):
        self.ns: dict[str, int] = {}
        self.clock = clock

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns[name] = self.ns.get(name, 0) + self.clock() - t0
        return timed

    def take(self) -> dict[str, int]:
        ns, self.ns = self.ns, {}
        return ns


class DroppingIO:
    """Stands in for the worker's I/O thread: encodes each message as the real one does
    (msgpack frames) and drops it, as no front-end listens here."""

    def send(self, message) -> None:
        encode(message)


def run_level(model_path: str, parallel: int, params: dict, backend_sampling: bool, num_steps: int, timers: Timers,
              zctx) -> dict:
    config = EngineConfig(model_path=model_path, parallel=parallel, ctx_size=256 * parallel,
                          backend_sampling=backend_sampling)
    engine = Engine(config)
    ring = create_ring(None, RING_CAPACITY_RECORDS)
    tick = zctx.socket(zmq.PUB)
    tick.setsockopt(zmq.LINGER, 0)
    tick.bind(f"inproc://bench-tick-{time.perf_counter_ns()}")
    try:
        publisher = EventPublisher(engine, Embedder(engine.runner, config), ring, DroppingIO(), tick)
        engine.step = timers.wrap("step", engine.step)
        engine._sample = timers.wrap("sample", engine._sample)
        engine._output.settle = timers.wrap("text", engine._output.settle)  # ids: end of generation, max_tokens
        engine._output.postprocess = timers.wrap("text", engine._output.postprocess)
        engine.runner.logits = timers.wrap("logits", engine.runner.logits)
        engine.runner.sampled_tokens = timers.wrap("logits", engine.runner.sampled_tokens)
        publish = timers.wrap("publish", publisher.publish)
        for i in range(parallel):
            body = {"prompt": f"{i}: {PROMPT}", "max_tokens": num_steps + 8, "ignore_eos": True, **params}
            engine.add_request(parse_request(i + 1, body))
        while any(seq.is_prefilling or not seq.output_ids for seq in engine.scheduler.running) \
                or engine.scheduler.waiting:
            publish(engine.step())
        timers.take()
        started = time.perf_counter()
        for _ in range(num_steps):
            publish(engine.step())
        wall_ns = (time.perf_counter() - started) * 1e9
        ns = timers.take()
    finally:
        tick.close()
        ring.close()
        ring.unlink()
        engine.close()
    decode = ns.get("llama_decode", 0)
    sample = ns.get("sample", 0) - ns.get("logits", 0)
    phases = {
        "schedule+fill": ns["step"] - decode - ns.get("sample", 0) - ns.get("text", 0),
        "logits": ns.get("logits", 0),
        "sample": sample,
        "text": ns.get("text", 0),
        "publish": ns.get("publish", 0),
    }
    per_step_ms = {name: value / num_steps / 1e6 for name, value in phases.items()}
    per_step_ms["host"] = sum(per_step_ms[name] for name in PHASES)
    per_step_ms["llama_decode"] = decode / num_steps / 1e6
    per_step_ms["step"] = wall_ns / num_steps / 1e6
    return per_step_ms


def main() -> None:
    parser = bench_parser(__doc__, model=None, parallel=[16, 64])
    parser.add_argument("--steps", type=int, default=32, help="decode steps measured per run")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--backend-sampling", nargs="+", default=["off", "on"], choices=["off", "on"],
                        help="run with sampling on the host (off), inside llama_decode's graph (on), or both")
    parser.add_argument("--vocab", type=int, default=FULL_VOCAB_TOKENS,
                        help="the stand-in model's vocabulary size (gemma's by default)")
    parser.add_argument("--model", default=os.path.join(tempfile.gettempdir(), "cbatch-full-vocab-tiny.gguf"),
                        help="where to write the stand-in model (rewritten only if it differs)")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="time the phases by the wall clock, or by the loop thread's CPU time (steadier on a "
                             "shared machine; llama_decode's figure is then only the loop thread's share of it)")
    parser.add_argument("--stats-interval", type=float, default=publisher_module.STATS_INTERVAL_S,
                        help="seconds between the stats the publisher sends with a step's events (default: the "
                             "worker's); a step slower than that sends them every time, as on this CPU, where "
                             "a GPU's steps of a few ms send them once in ~100 steps: 'inf' leaves them out")
    args = parser.parse_args()
    publisher_module.STATS_INTERVAL_S = args.stats_interval

    model_path = make_tiny_model(args.model, num_tokens=args.vocab)
    timers = Timers(time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns)
    lc.llama_decode = timers.wrap("llama_decode", lc.llama_decode)  # the runner looks it up per call
    zctx = zmq.Context()
    note(f"model {model_path} ({args.vocab} tokens, tiny body); {args.steps} decode steps per run")
    figures = Table("ms per decode step, by phase", "mode", "seqs", "backend", *(f"{name} ms" for name in PHASES),
                    "host total ms", "llama_decode ms", "step ms")
    for mode in args.modes:
        for parallel in args.parallel:
            for backend in args.backend_sampling:
                r = run_level(model_path, parallel, MODES[mode], backend == "on", args.steps, timers, zctx)
                figures.row(mode, parallel, backend, *(r[name] for name in PHASES), r["host"], r["llama_decode"],
                            r["step"])
    zctx.term()

