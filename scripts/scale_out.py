"""Try the scale-out recipe on one machine: N cbatch-worker --http daemons and the smg
router in front of them, with the health checks docs/scale-out.md tunes. It prints the
router's URL and runs until Ctrl-C or SIGTERM, then stops the router and drains every
daemon. Needs the router extra (pip install 'cbatch[router]'; the test extras include it).

    .venv/bin/python scripts/scale_out.py --daemons 2 --port 8000 [--pin] [-- WORKER FLAGS...]

Daemon i listens on port+1+i and on its own ipc:// endpoint in a scratch directory; with
--pin it is bound to CPU i (taskset-style, through its affinity mask, so its --threads
default is 1). The functions are the benchmark's too (scripts/bench.py scale_out).
"""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
# A dead daemon is left out after two failed checks a second apart (smg's default: 3
# checks a minute apart), a restarted one taken back after one good check; no circuit
# breaker, which shunned a restarted daemon for 60 s after its drain's 503s.
HEALTH_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                "--health-success-threshold", "1", "--health-check-timeout-secs", "1", "--disable-circuit-breaker"]
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def wait_http(url: str, is_ready, timeout_s: float = READY_TIMEOUT_S, headers: dict | None = None,
              process: subprocess.Popen | None = None, log_path: Path | None = None) -> None:
    """Until is_ready(GET url); a `process` that exits first fails at once, with its log's end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = log_path.read_text()[-2000:] if log_path is not None else ""
            raise RuntimeError(f"{url}: the process exited ({process.returncode}) before it was ready:\n{tail}")
        try:
            if is_ready(httpx.get(url, headers=headers, timeout=2.0)):
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready in {timeout_s:.0f} s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ScaleOut:
    """The daemons and the router; stop() ends them all, router first."""

    def __init__(self):
        self.workdir = Path(tempfile.mkdtemp(prefix="cbso-"))
        self.daemons: list[subprocess.Popen] = []
        self.daemon_urls: list[str] = []
        self.router: subprocess.Popen | None = None
        self.router_url = ""

    def start_daemon(self, port: int, args: list[str], cpus: set[int] | None = None) -> str:
        index = len(self.daemons)
        log = open(self.workdir / f"daemon-{index}.log", "w")
        endpoint = f"ipc://{self.workdir}/daemon-{index}.sock"
        process = subprocess.Popen(
            [str(BIN / "cbatch-worker"), "--http", str(port), "--endpoint", endpoint, *args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "XDG_RUNTIME_DIR": str(self.workdir)},
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        self.daemons.append(process)
        url = f"http://127.0.0.1:{port}"
        self.daemon_urls.append(url)
        wait_http(f"{url}/health", lambda reply: reply.status_code == 200, process=process,
                  log_path=self.workdir / f"daemon-{index}.log")
        return url

    def start_router(self, port: int, policy: str, worker_urls: list[str] | None = None,
                     extra: list[str] | None = None) -> str:
        urls = worker_urls or self.daemon_urls
        log = open(self.workdir / "smg.log", "w")
        self.router = subprocess.Popen(
            [str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
             # its own metrics: on loopback, and on a free port (smg's default, 29000, may be taken)
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--policy", policy, *HEALTH_FLAGS, "--log-level", "warn", *(extra or [])],
            stdout=log, stderr=subprocess.STDOUT)
        self.router_url = f"http://127.0.0.1:{port}"
        wait_http(f"{self.router_url}/readiness",
                  lambda reply: reply.status_code == 200 and reply.json().get("healthy_workers") == len(urls))
        return self.router_url

    def stop_router(self) -> None:
        if self.router is not None:
            _stop(self.router)
            self.router = None

    def stop(self) -> list[int]:
        """Router first (no request goes to a draining daemon), then every daemon drains."""
        self.stop_router()
        for process in self.daemons:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = [_stop(process) for process in self.daemons]
        shutil.rmtree(self.workdir, ignore_errors=True)
        return codes


def _stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="N cbatch daemons behind the smg router, on this machine.")
    parser.add_argument("--daemons", type=int, default=2, help="how many daemons (default 2)")
    parser.add_argument("--port", type=int, default=8000,
                        help="the router's port; daemon i gets port+1+i (default 8000)")
    parser.add_argument("--policy", default="cache_aware", help="smg's routing policy (default cache_aware)")
    parser.add_argument("--pin", action="store_true", help="bind daemon i to CPU i")
    parser.add_argument("worker_args", nargs="*", help="after --: flags for every cbatch-worker")
    args = parser.parse_args()
    if args.daemons < 1:
        parser.error("--daemons must be >= 1")
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and args.daemons > len(cpus):
        parser.error(f"--pin needs a CPU per daemon: {len(cpus)} available")
    # SIGTERM stops the run as Ctrl-C does, and neither interrupts a start half-way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    scale_out = ScaleOut()
    try:
        for i in range(args.daemons):
            scale_out.start_daemon(args.port + 1 + i, args.worker_args, {cpus[i]} if args.pin else None)
        url = scale_out.start_router(args.port, args.policy)
        print(f"router at {url}/v1 in front of {args.daemons} daemons ({', '.join(scale_out.daemon_urls)}); "
              f"logs in {scale_out.workdir}; Ctrl-C stops them all", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        codes = scale_out.stop()
    print(f"stopped: router and {len(codes)} daemons (exit codes {codes})", flush=True)
    sys.exit(0 if all(code == 0 for code in codes) else 1)


if __name__ == "__main__":
    main()
