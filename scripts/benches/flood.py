"""What one flooding client costs the others: the latency of a well-behaved client's short
requests before, during and after another client submits in a loop without reading, and
after that client is killed.

The flooder's own requests ask for one token each, so the others wait behind the queue it
fills (at most --max-queue) for little decode time; what the figure shows beyond that is
front-end work spent on the flooder.

Prints a table row per phase (the median, p90 and longest of the short requests' times, how
many finished and failed), then notes: the failed requests' error codes, how long the
flooder's requests outlived it, and whether the daemon is still alive.

    .venv/bin/python scripts/bench.py flood --model /tmp/tiny.gguf
"""

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benches.options import bench_parser
from benches.peers import BIN_DIR
from benches.report import Table, note
from cbatch.client import Client
from cbatch.errors import CbatchError

GREEDY = {"temperature": 0.0, "ignore_eos": True}
FLOOD = """
import sys
from cbatch.client import Client
client = Client(sys.argv[1])
print("flooding", flush=True)
while True:
    client.submit(prompt="x", max_tokens=1, temperature=0.0)
"""


def latencies_s(endpoint: str, num_requests: int, max_tokens: int) -> tuple[list[float], Counter]:
    """Seconds each finished request took, and the error codes of those that failed."""
    found, failures = [], Counter()
    with Client(endpoint) as client:
        for _ in range(num_requests):
            started = time.perf_counter()
            try:
                client.generate(prompt="The river", max_tokens=max_tokens, **GREEDY)
            except CbatchError as err:
                failures[err.code] += 1
                continue
            found.append(time.perf_counter() - started)
    return found, failures


def add_row(latencies: Table, phase: str, measured: tuple[list[float], Counter]) -> Counter:
    """Print the phase's row (no figures when no request finished); the failed requests'
    error codes, for a note once the table is done."""
    found, failures = measured
    if not found:
        latencies.row(phase, None, None, None, 0, failures.total())
        return failures
    ordered = sorted(found)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    latencies.row(phase, statistics.median(found), p90, ordered[-1], len(found), failures.total())
    return failures


def main() -> None:
    parser = bench_parser(__doc__, parallel=4, requests=(10, "short requests timed in each phase"), max_tokens=8)
    parser.add_argument("--flood-s", type=float, default=3.0, help="how long the flooder runs before timing starts")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="cbatch-flood-"))
    endpoint = f"ipc://{workdir / 'cbatch.sock'}"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(workdir)}
    model_args = ["--model", args.model] if args.model else []
    daemon = subprocess.Popen([str(BIN_DIR / "cbatch-worker"), *model_args, "--parallel", str(args.parallel),
                               "--endpoint", endpoint, "-q"], env=env, stderr=subprocess.DEVNULL)
    flooder = None
    try:
        deadline = time.monotonic() + 120.0
        while not (workdir / "cbatch.sock").exists():  # the daemon binds once the model is loaded
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("cbatch-worker did not start")
            time.sleep(0.2)
        latencies_s(endpoint, 2, args.max_tokens)  # warm-up: the first prompt pages the model in
        latencies = Table(f"the well-behaved client's requests ({args.max_tokens} tokens each)", "phase",
                          "median s", "p90 s", "max s", "finished", "failed", widths={"phase": 16})
        failures = {"quiet": add_row(latencies, "quiet", latencies_s(endpoint, args.requests, args.max_tokens))}
        flooder = subprocess.Popen([sys.executable, "-c", FLOOD, endpoint], stdout=subprocess.PIPE, env=env)
        flooder.stdout.readline()
        time.sleep(args.flood_s)
        failures["while one floods"] = add_row(latencies, "while one floods",
                                               latencies_s(endpoint, args.requests, args.max_tokens))
        flooder.send_signal(signal.SIGKILL)
        flooder.wait()
        killed_at = time.perf_counter()
        with Client(endpoint) as client:  # what the flooder left in flight is cancelled, not run
            while client.stats()["num_in_flight"] > 0:
                time.sleep(0.05)
        gone_s = time.perf_counter() - killed_at
        failures["flooder killed"] = add_row(latencies, "flooder killed",
                                             latencies_s(endpoint, args.requests, args.max_tokens))
        for phase, codes in failures.items():
            if codes:
                note(f"{phase}: the failed requests' error codes {dict(codes)}")
        note(f"the flooder's requests were gone {gone_s:.2f} s after it was killed")
        note(f"daemon alive: {daemon.poll() is None}")
    finally:
        if flooder is not None and flooder.poll() is None:
            flooder.kill()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)

