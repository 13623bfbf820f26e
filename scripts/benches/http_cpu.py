"""The HTTP server's CPU per request, with each of uvicorn's HTTP parsers, side by side in
one run: httptools (C, the default) and h11 (pure Python, CBATCH_HTTP_PARSER=h11); or with
--loops, each event loop: asyncio's own (the default) and uvloop's (CBATCH_HTTP_LOOP=uvloop,
when uvloop is installed), both on httptools.

    .venv/bin/python scripts/bench.py http_cpu [--model M.gguf] [--requests 400] [--callers 4] [--rounds 2] [--loops]

Short requests (max_tokens 1 by default) on the tiny model, so that per-request work, not
decoding, is what is measured. The callers are light: threads with `http.client`, one
keep-alive connection each (or a new connection per request with --new-connections). The
figures are CPU seconds read from /proc: the HTTP server process(es) and the whole daemon
per request, and this load generator's own CPU, flagged when it used more than a third of
a core (then it, not the server, may set the pace). A table per round, a row per parser
(or loop); then notes: the flag, and the other's HTTP CPU per request over the default's.
"""

import http.client
import json
import tempfile
import time
from pathlib import Path

from tiny_models.llama import make_tiny_model

from benches.callers import run_clients
from benches.options import bench_parser
from benches.peers import CbatchDaemon, free_port
from benches.proc_cpu import process_cpu_s
from benches.report import Table, note

# Each comparison: (the default, the other), each with the environment that picks it.
PARSERS = {"httptools": {"CBATCH_HTTP_PARSER": "httptools"}, "h11": {"CBATCH_HTTP_PARSER": "h11"}}
LOOPS = {"asyncio": {"CBATCH_HTTP_LOOP": "asyncio"}, "uvloop": {"CBATCH_HTTP_LOOP": "uvloop"}}
LIGHT_CALLER_CORES = 1 / 3  # more than this and the load generator may be the bottleneck



def wait_for_http(port: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.2)
    raise RuntimeError(f"the HTTP server on port {port} never answered /health with 200")


def daemon_pids(daemon: CbatchDaemon) -> tuple[list[int], list[int]]:
    """(the HTTP server processes, every process of the daemon) from its log and /proc."""
    log = (daemon.workdir / "daemon.log").read_text()
    http = [int(line.rsplit("pid ", 1)[1].rstrip(")")) for line in log.splitlines() if "cbatch http: serving" in line]
    children = Path(f"/proc/{daemon.process.pid}/task/{daemon.process.pid}/children").read_text().split()
    return http, [daemon.process.pid, *map(int, children)]


def run_callers(port: int, num_requests: int, num_callers: int, max_tokens: int, is_new_connection: bool) -> float:
    """Seconds to answer num_requests, each caller sending its share one after another."""
    body = json.dumps({"prompt": "x", "max_tokens": max_tokens, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    errors: list[str] = []

    def caller(count: int) -> None:
        connection = None
        for _ in range(count):
            if connection is None or is_new_connection:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            connection.request("POST", "/v1/completions", body, headers)
            reply = connection.getresponse()
            reply.read()
            if reply.status != 200:
                errors.append(f"HTTP {reply.status}")
            if is_new_connection:
                connection.close()

    elapsed_s = run_clients(num_callers, lambda _: caller(num_requests // num_callers))
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return elapsed_s


def measure(model: str, name: str, env: dict, args) -> dict:
    port = free_port()
    daemon = CbatchDaemon(model, args.parallel, ["--http", str(port), "--http-processes", "1"], extra_env=env)
    try:
        wait_for_http(port)
        run_callers(port, args.callers * 4, args.callers, args.max_tokens, args.new_connections)  # warm up
        http_pids, all_pids = daemon_pids(daemon)
        http_before, all_before = sum(map(process_cpu_s, http_pids)), sum(map(process_cpu_s, all_pids))
        own_before = time.process_time()
        wall_s = run_callers(port, args.requests, args.callers, args.max_tokens, args.new_connections)
        num = args.requests // args.callers * args.callers
        return {"name": name, "num_requests": num, "requests_per_s": num / wall_s,
                "http_cpu_ms": 1000 * (sum(map(process_cpu_s, http_pids)) - http_before) / num,
                "daemon_cpu_ms": 1000 * (sum(map(process_cpu_s, all_pids)) - all_before) / num,
                "caller_cores": (time.process_time() - own_before) / wall_s}
    finally:
        daemon.stop()


def main() -> None:
    parser = bench_parser(__doc__, model=None, parallel=8, requests=400, max_tokens=1, rounds=2)
    parser.add_argument("--model", default=None, help="GGUF (default: the tiny test model, written to a temp dir)")
    parser.add_argument("--callers", type=int, default=4)
    parser.add_argument("--new-connections", action="store_true", help="a new connection per request, as curl")
    parser.add_argument("--loops", action="store_true",
                        help="compare the event loops (asyncio, uvloop), not the parsers")
    args = parser.parse_args()
    model = args.model or make_tiny_model(Path(tempfile.mkdtemp(prefix="cbb-")) / "tiny.gguf")
    note(f"{args.requests} requests of {args.max_tokens} token(s), {args.callers} callers, "
         f"{'a new connection each' if args.new_connections else 'keep-alive'}, --parallel {args.parallel}")
    variants = LOOPS if args.loops else PARSERS
    default, other = variants
    variant_column = "loop" if args.loops else "parser"
    for round_number in range(1, args.rounds + 1):
        figures = Table(f"round {round_number}", variant_column, "req/s", "HTTP CPU ms/req", "daemon CPU ms/req",
                        "load generator cores", widths={variant_column: max(map(len, variants))})
        rows = {}
        for name, env in variants.items():
            rows[name] = measure(model, name, env, args)
            figures.row(name, rows[name]["requests_per_s"], rows[name]["http_cpu_ms"], rows[name]["daemon_cpu_ms"],
                        rows[name]["caller_cores"])
        heavy = [name for name, row in rows.items() if row["caller_cores"] > LIGHT_CALLER_CORES]
        if heavy:
            note(f"round {round_number}: the load generator used over {LIGHT_CALLER_CORES:.2f} of a core beside "
                 f"{', '.join(heavy)}: it, not the server, may have set the pace")
        ratio = cpu_ratio(rows[other], rows[default])
        note(f"round {round_number}: HTTP CPU per request {other} / {default} = {ratio}")


def cpu_ratio(row: dict, default: dict) -> str:
    """The kernel counts CPU time in clock ticks (10 ms): a short run can show none for the faster one."""
    if default["http_cpu_ms"] == 0:
        return (f"not measured ({default['name']} used under one clock tick for {default['num_requests']} "
                "requests: raise --requests)")
    return f"{row['http_cpu_ms'] / default['http_cpu_ms']:.2f}x"

