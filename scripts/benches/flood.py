"""What one flooding client costs the others: the latency of a well-behaved client's short
requests before, during and after another client submits in a loop without reading, and
after that client is killed.

The flooder's own requests ask for one token each, so the others wait behind the queue it
fills (at most --max-queue) for little decode time; what the figure shows beyond that is
front-end work spent on the flooder.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benches.peers import BIN_DIR
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


def report(phase: str, measured: tuple[list[float], Counter]) -> None:
    found, failures = measured
    failed = f"; failed: {dict(failures)}" if failures else ""
    if not found:
        print(f"{phase:>18}: no request finished{failed}")
        return
    ordered = sorted(found)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    print(f"{phase:>18}: median {statistics.median(found):.3f} s  p90 {p90:.3f} s  max {ordered[-1]:.3f} s  "
          f"(n={len(found)}){failed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded default model)")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--requests", type=int, default=10, help="short requests timed in each phase")
    parser.add_argument("--max-tokens", type=int, default=8)
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
        report("quiet", latencies_s(endpoint, args.requests, args.max_tokens))
        flooder = subprocess.Popen([sys.executable, "-c", FLOOD, endpoint], stdout=subprocess.PIPE, env=env)
        flooder.stdout.readline()
        time.sleep(args.flood_s)
        report("while one floods", latencies_s(endpoint, args.requests, args.max_tokens))
        flooder.send_signal(signal.SIGKILL)
        flooder.wait()
        killed_at = time.perf_counter()
        with Client(endpoint) as client:  # what the flooder left in flight is cancelled, not run
            while client.stats()["num_in_flight"] > 0:
                time.sleep(0.05)
        print(f"the flooder's requests were gone {time.perf_counter() - killed_at:.2f} s after it was killed")
        report("flooder killed", latencies_s(endpoint, args.requests, args.max_tokens))
        print(f"daemon alive: {daemon.poll() is None}")
    finally:
        if flooder is not None and flooder.poll() is None:
            flooder.kill()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)

