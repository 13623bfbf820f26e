"""Interactive time to first token beside a saturating batch load, with batch preemption
on (the default) and off (--no-preempt-batch).

For each setting one daemon: first --probes interactive requests one after another on the
idle daemon (streamed, each timed from its submit to its first token), then the same
probes beside --parallel batch-priority streams that hold every slot (each asks for
--batch-tokens tokens and sends its next request as soon as one ends). With preemption
an interactive probe takes a batch stream's slot at the next step; without it, it waits
for the first batch request to end. One table, a row per setting and phase: the probes'
p50 and p99, and beside the load the batch requests' own duration, for scale, and the
daemon's preemptions; then a note of the CPU the figures come from.

    .venv/bin/python scripts/make_tiny_model.py /tmp/tiny.gguf
    .venv/bin/python scripts/bench.py preempt --model /tmp/tiny.gguf --parallel 4
"""

import os
import platform
import threading
import time
from pathlib import Path

import numpy as np

from benches.options import bench_parser
from benches.peers import CbatchDaemon
from benches.priorities import ms, probe
from benches.report import Table, note
from cbatch.client import Client
from cbatch.model import resolve_model_path

LOAD_WAIT_S = 60.0  # for the batch streams to hold every slot


class BatchLoad:
    """`parallel` threads, each sending batch-priority requests back to back until stopped."""

    def __init__(self, endpoint: str, parallel: int, max_tokens: int):
        self.durations_s: list[float] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(endpoint, i, max_tokens)) for i in range(parallel)]
        for thread in self._threads:
            thread.start()

    def _run(self, endpoint: str, i: int, max_tokens: int) -> None:
        with Client(endpoint) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                client.generate(prompt=f"Batch stream {i}: carry on counting", max_tokens=max_tokens, temperature=0,
                                ignore_eos=True, priority="batch")
                self.durations_s.append(time.perf_counter() - started)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def wait_saturated(client: Client, parallel: int) -> None:
    """Every batch stream has a request in flight. (The front-end counts those exactly; the
    worker's num_active is a snapshot, often taken while a fast model idles between two of a
    stream's requests.)"""
    deadline = time.monotonic() + LOAD_WAIT_S
    while client.stats()["num_in_flight"] < parallel:
        if time.monotonic() > deadline:
            raise RuntimeError("the batch streams did not fill every slot")
        time.sleep(0.1)


def measure(model_path: str, args, preempt: bool) -> dict:
    daemon = CbatchDaemon(model_path, args.parallel, [] if preempt else ["--no-preempt-batch"])
    load = None
    try:
        with Client(daemon.endpoint) as client:
            probe(client, 3, args.probe_tokens, "interactive")  # warm-up
            idle, _ = probe(client, args.probes, args.probe_tokens, "interactive")
            load = BatchLoad(daemon.endpoint, args.parallel, args.batch_tokens)
            wait_saturated(client, args.parallel)
            busy, _ = probe(client, args.probes, args.probe_tokens, "interactive")
            load.stop()
            num_preemptions = client.stats()["num_preemptions"]
    finally:
        if load is not None:
            load.stop()
        daemon.stop()
    return {"idle": idle, "busy": busy, "batch_s": load.durations_s, "num_preemptions": num_preemptions}


def cpu_description() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return (f"{names[0] if names else platform.processor() or 'unknown CPU'}, {len(os.sched_getaffinity(0))} usable "
            f"of {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")


def main(argv=None) -> None:
    parser = bench_parser(__doc__, parallel=4)
    parser.add_argument("--batch-tokens", type=int, default=256, help="max_tokens of each batch request")
    parser.add_argument("--probes", type=int, default=50, help="interactive probes per phase")
    parser.add_argument("--probe-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    model_path = str(resolve_model_path(args.model))
    note(f"model {Path(model_path).name}, --parallel {args.parallel}, {args.parallel} batch streams of "
         f"{args.batch_tokens}-token requests, {args.probes} interactive probes a phase of {args.probe_tokens} tokens")
    ttfts = Table("interactive TTFT", "preemption", "daemon", "TTFT p50 ms", "TTFT p99 ms", "batch request p50 s",
                  "preemptions", widths={"daemon": 17})
    for preempt in (True, False):
        result = measure(model_path, args, preempt)
        setting = "on" if preempt else "off"
        batch_s = float(np.median(result["batch_s"])) if result["batch_s"] else None
        ttfts.row(setting, "idle", ms(result["idle"], 50), ms(result["idle"], 99), None, None)
        ttfts.row(setting, "beside batch load", ms(result["busy"], 50), ms(result["busy"], 99), batch_s,
                  result["num_preemptions"])
    note(f"CPU: {cpu_description()}")

