"""Two tenants on one daemon, a heavy one sending ten times the light one's load, with fair
share on and off (`cbatch-worker --no-fair-share`), one daemon after the other.

Each daemon serves HTTP with a keys file of two tenants of equal weight. The heavy tenant
runs --heavy-factor times the light one's callers (scripts/benches/loadgen.py, closed loops), so
both keep requests waiting: once the heavy load has filled the queue, the light tenant
sends --light-requests streamed requests, and the run is the time they take. A table row
per daemon: each tenant's share of the tokens generated over the run (from the daemon's
usage per tenant, so a request that ends just after the light ones began counts whole),
the tokens and the run's length, the light tenant's time to first token (p50 and p99), and
the CPU the load generators used over the run (seconds, and cores: seconds per second of
the run). With fair share the light tenant should get about half the tokens and a
short wait; without, about 1 / (1 + heavy-factor), behind the heavy backlog.

    .venv/bin/python scripts/make_tiny_model.py /tmp/tiny.gguf
    .venv/bin/python scripts/bench.py fair_share --model /tmp/tiny.gguf
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benches import proc_cpu
from benches.options import REQUIRED, bench_parser
from benches.peers import CbatchDaemon, free_port, wait_http
from benches.report import Table, note
from benches.serving import LOADGEN

KEYS = "heavy key-heavy\nlight key-light\n"  # equal weights: fair share means equal tokens
BACKLOG_TIMEOUT_S = 120.0


def loadgen_command(url: str, prompts_path: Path, key: str, clients: int, max_tokens: int) -> list[str]:
    body = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    return [sys.executable, str(LOADGEN), "--url", url, "--prompts", str(prompts_path), "--body", body,
            "--clients", str(clients), "--api-key", key]


def write_prompts(path: Path, tenant: str, num_prompts: int) -> Path:
    path.write_text(json.dumps([f"{tenant} request {i}: tell me a story" for i in range(num_prompts)]))
    return path


def wait_backlog(daemon: CbatchDaemon, num_heavy_clients: int) -> None:
    """Until every heavy caller has a request in flight (the front-end's exact count: with
    more callers than slots, the rest of them wait in the queue). The worker's queue depth
    lags by a stats interval, and with few callers a sample can miss the moment it is full."""
    deadline = time.monotonic() + BACKLOG_TIMEOUT_S
    while daemon.stats()["tenants"].get("heavy", {}).get("num_in_flight", 0) < num_heavy_clients:
        if time.monotonic() > deadline:
            raise RuntimeError("the heavy tenant's callers never all had a request in flight")
        time.sleep(0.05)


def measure(args, workdir: Path, fair_share: bool) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--http", str(port), "--api-keys-file", str(workdir / "keys"), "--http-processes", "1", "-q",
             *([] if fair_share else ["--no-fair-share"]), *(["-t", str(args.threads)] if args.threads else [])]
    daemon = CbatchDaemon(args.model, args.parallel, flags)
    heavy = None
    try:
        wait_http(url)
        num_heavy_clients = args.light_clients * args.heavy_factor
        heavy_prompts = write_prompts(workdir / "heavy.json", "heavy", 100 * num_heavy_clients)
        light_prompts = write_prompts(workdir / "light.json", "light", args.light_requests)
        heavy = subprocess.Popen(loadgen_command(url, heavy_prompts, "key-heavy", num_heavy_clients, args.max_tokens),
                                 stdout=subprocess.DEVNULL)
        wait_backlog(daemon, num_heavy_clients)
        before = daemon.stats()["tenants"]
        heavy_cpu_before_s, started = proc_cpu.process_cpu_s(heavy.pid), time.perf_counter()
        light = subprocess.run([*loadgen_command(url, light_prompts, "key-light", args.light_clients, args.max_tokens),
                                "--stream"], capture_output=True, text=True, check=True)
        elapsed_s = time.perf_counter() - started
        heavy_cpu_s = proc_cpu.process_cpu_s(heavy.pid) - heavy_cpu_before_s
        after = daemon.stats()["tenants"]
    finally:
        if heavy is not None:
            heavy.terminate()
            heavy.wait(timeout=60)
        daemon.stop()
    result = json.loads(light.stdout)
    if result["errors"]:
        raise RuntimeError(f"light tenant's requests failed: {result['errors'][:3]}")
    generated = {tenant: after[tenant]["num_generated_tokens"] - before.get(tenant, {}).get("num_generated_tokens", 0)
                 for tenant in ("heavy", "light")}
    return {"generated": generated, "ttft_ms": np.percentile(np.array(result["ttft_s"]) * 1000, [50, 99]),
            "elapsed_s": elapsed_s, "caller_cpu_s": heavy_cpu_s + result["cpu_s"], "num_light": result["requests"]}


def main() -> None:
    parser = bench_parser(__doc__, model=REQUIRED, parallel=4, max_tokens=32)
    parser.add_argument("--threads", type=int, default=0, help="the daemon's -t (default: its own default)")
    parser.add_argument("--light-clients", type=int, default=4, help="the light tenant's callers")
    parser.add_argument("--heavy-factor", type=int, default=10, help="the heavy tenant's callers per light one")
    parser.add_argument("--light-requests", type=int, default=100, help="the light tenant's requests: the run")
    args = parser.parse_args()
    note(f"--parallel {args.parallel}, {args.max_tokens} tokens a request; light: {args.light_clients} callers, "
         f"{args.light_requests} streamed requests; heavy: {args.light_clients * args.heavy_factor} callers")
    with tempfile.TemporaryDirectory(prefix="cbbfs-") as tmp:
        workdir = Path(tmp)
        (workdir / "keys").write_text(KEYS)
        runs = Table("the tokens generated over the run, and the light tenant's wait", "fair share", "heavy tokens %",
                     "light tokens %", "tokens", "run s", "light TTFT p50 ms", "light TTFT p99 ms", "loadgen CPU s",
                     "loadgen cores")
        for fair_share in (True, False):
            run = measure(args, workdir, fair_share)
            total = sum(run["generated"].values())
            p50, p99 = run["ttft_ms"]
            runs.row("on" if fair_share else "off", 100 * run["generated"]["heavy"] / total,
                     100 * run["generated"]["light"] / total, total, run["elapsed_s"], float(p50), float(p99),
                     run["caller_cpu_s"], run["caller_cpu_s"] / run["elapsed_s"])

