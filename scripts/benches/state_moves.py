"""What moving KV states between the slots and the host tier costs the decode loop: the
engine in-process (the decode worker's loop, without its sockets) runs --streams long
generations beside --conversations conversations that take turns on --slots more slots,
so that every few steps a stream's state is saved to host memory or restored from it.

Printed, after the setup: a table of the steps, all of them, then those that decode only
and those that also compute prompt tokens (the step that admits a returning turn prefills
its new tokens too), each kind with no state moved and with one: their count, median and
slowest step, and the slowest with a state moved against the median step of its kind (the
target, met or missed in a note: at most 2x); then the saves' and restores' own times and
sizes against the median step; then the host tier's hits and the prompt tokens computed
and reused.

    .venv/bin/python scripts/bench.py state_moves [--model GGUF] [--streams 16] [--slots 4]
"""

import statistics
import time

from benches.options import bench_parser
from benches.report import Table, note
from cbatch.config import EngineConfig
from cbatch.model import resolve_model_path
from cbatch.params import parse_request
from cbatch.workers.engine.engine import Engine
from cbatch.workers.engine.kv.base import OP_RESTORE, OP_SAVE

WORDS = "river stone light garden window paper music winter market engine story number silver forest".split()


class TimedOps:
    """Wraps the runner's apply_memory_ops: the time and bytes of each save and restore."""

    def __init__(self, runner):
        self.runner, self.apply = runner, runner.apply_memory_ops
        self.saves: list[tuple[float, int]] = []
        self.restores: list[tuple[float, int]] = []
        self.moved_in_step = False
        runner.apply_memory_ops = self

    def __call__(self, ops):
        failed = []
        for op in ops:
            started = time.perf_counter()
            failed += self.apply([op])
            elapsed = time.perf_counter() - started
            if op[0] == OP_SAVE and op[2].state is not None:
                self.saves.append((elapsed, len(op[2].state) + len(op[2].checkpoint_state or b"")))
                self.moved_in_step = True
            elif op[0] == OP_RESTORE:
                self.restores.append((elapsed, len(op[2].state) + len(op[2].checkpoint_state or b"")))
                self.moved_in_step = True
        return failed


def words(rng_index: int, count: int) -> str:
    return " ".join(WORDS[(rng_index * 7 + i * 3) % len(WORDS)] for i in range(count))


def main(argv=None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--streams", type=int, default=16, help="long generations decoding all along")
    parser.add_argument("--slots", type=int, default=4, help="slots the conversations share")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--history-words", type=int, default=1000)
    parser.add_argument("--ctx-per-seq", type=int, default=4096)
    args = parser.parse_args(argv)
    parallel = args.streams + args.slots
    engine = Engine(EngineConfig(model_path=resolve_model_path(args.model), parallel=parallel,
                                 ctx_size=parallel * args.ctx_per_seq))
    timed = TimedOps(engine.runner)
    ids = iter(range(1, 1 << 30))
    # Step times by (computes prompt tokens, moved a state)
    steps: dict[tuple[bool, bool], list[float]] = {(p, m): [] for p in (False, True) for m in (False, True)}

    def submit(body: dict) -> int:
        request = parse_request(next(ids), body)
        engine.add_request(request)
        return request.request_id

    for i in range(args.streams):
        submit({"prompt": f"Story {i}: " + words(i, 40), "max_tokens": 1 << 20, "temperature": 0, "ignore_eos": True})
    histories = [f"Conversation {i}: " + words(100 + i, args.history_words) for i in range(args.conversations)]
    waiting = {submit({"prompt": h, "max_tokens": 16, "temperature": 0, "ignore_eos": True}): (i, 0)
               for i, h in enumerate(histories)}
    texts: dict[int, str] = {}
    while waiting:
        timed.moved_in_step = False
        computed_before, started = engine.stats.num_prompt_tokens_computed, time.perf_counter()
        events = engine.step()
        is_prefill = engine.stats.num_prompt_tokens_computed > computed_before
        steps[is_prefill, timed.moved_in_step].append(time.perf_counter() - started)
        for event in events:
            if event.request_id in waiting:
                texts[event.request_id] = texts.get(event.request_id, "") + event.text
                if event.finish_reason:
                    conversation, turn = waiting.pop(event.request_id)
                    histories[conversation] += texts.pop(event.request_id) + " " + words(turn, 12)
                    if turn + 1 < args.turns:
                        request_id = submit({"prompt": histories[conversation], "max_tokens": 16, "temperature": 0,
                                             "ignore_eos": True})
                        waiting[request_id] = (conversation, turn + 1)
    stats = engine.snapshot()
    engine.close()
    all_steps = [t for times in steps.values() for t in times]
    median = statistics.median(all_steps)

    def count_median_slowest_ms(times: list[float]) -> tuple:
        return (len(times), 1000 * statistics.median(times), 1000 * max(times)) if times else (0, None, None)

    note(f"{args.streams} streams decoding beside {args.conversations} conversations x {args.turns} turns on "
         f"{args.slots} slots ({args.history_words}-word histories)")
    step_times = Table("Step times, with and without a state moved", "steps", "state moved", "count", "median ms",
                       "slowest ms", "x its median", widths={"steps": 18})
    step_times.row("all", "either", *count_median_slowest_ms(all_steps), None)
    ratios = []  # of each kind, its slowest step that moved a state over its median step with none moved
    for is_prefill, kind in ((False, "decode only"), (True, "with prompt tokens")):
        still, moved = steps[is_prefill, False], steps[is_prefill, True]
        step_times.row(kind, "no", *count_median_slowest_ms(still), None)
        if moved:
            ratios.append(max(moved) / (statistics.median(still) if still else median))
        step_times.row(kind, "yes", *count_median_slowest_ms(moved), ratios[-1] if moved else None)
    if ratios:
        note(f"target: the slowest step with a state moved at most 2x the median step of its kind: "
             f"{max(ratios):.2f}x, {'met' if max(ratios) <= 2 else 'missed'}")
    moves = Table("State moves between the slots and the host tier", "move", "count", "median ms", "slowest ms",
                  "slowest % of median step", "median MB")
    for name, timings in (("saves", timed.saves), ("restores", timed.restores)):
        times = [t for t, _ in timings]
        moves.row(name, *count_median_slowest_ms(times), 100 * max(times) / median if times else None,
                  statistics.median(b for _, b in timings) / 1e6 if timings else None)
    tokens = Table("Prompt tokens and the host tier", "run", "host tier hits", "prompt tokens computed",
                   "prompt tokens reused", widths={"run": 9})
    tokens.row("whole run", stats.get("host_cache_hits", 0), stats["prompt_tokens_computed"],
               stats["prompt_tokens_reused"])
