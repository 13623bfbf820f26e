"""A real cbatch-worker daemon with its HTTP server, for the HTTP tests."""

import time

import httpx
from common import free_port
from daemonkit import Daemon, child_pids

HTTP_READY_TIMEOUT_S = 60.0


class HttpDaemon(Daemon):
    """A daemon started with --http on a free port (or `host`:`port`); ready once GET
    /health is 200 (or just started, with is_waited false)."""

    def __init__(self, model_path: str, *args: str, is_waited: bool = True, host: str = "127.0.0.1",
                 port: int | None = None, **options):
        self.port = port or free_port()
        self.is_waited = is_waited
        self.base_url = f"http://{host}:{self.port}"
        super().__init__(model_path, "--http", f"{host}:{self.port}", *args, **options)
        if is_waited:
            self.stopped_unless(lambda: self.wait_http_status(200))

    def _wait_ready(self) -> dict:
        return super()._wait_ready() if self.is_waited else {}

    def wait_http_status(self, status: int, timeout_s: float = HTTP_READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == status:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.05)
        raise RuntimeError(f"/health never answered {status}: {self.log()}")

    def http_pids(self) -> list[int]:
        """The HTTP server processes the daemon started, in order (from its log)."""
        return [int(line.rsplit("pid ", 1)[1].rstrip(")")) for line in self.log().splitlines()
                if line.startswith("cbatch http: serving")]

    def new_decode_worker_pid(self, old_pid: int = 0, timeout_s: float = 60.0) -> int:
        """The pid of the daemon's decode worker once one other than old_pid runs (looked
        for often: the tests stop it before it has loaded the model)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for pid in child_pids(self.process.pid):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                        if pid != old_pid and b"spawn_main" in cmdline.read():
                            return pid
                except FileNotFoundError:
                    continue
            time.sleep(0.005)
        raise RuntimeError(f"no new decode worker: {self.log()}")

    def openai(self, **options):
        import openai

        return openai.OpenAI(**{"base_url": f"{self.base_url}/v1", "api_key": "unused", "max_retries": 0, **options})

    def metrics(self) -> dict:
        """/metrics as {(sample name, sorted label pairs): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def wait_idle(self, timeout_s: float) -> float:
        """Seconds until the daemon runs no sequence (stats reach the front-end every 0.25 s)."""
        started = time.monotonic()
        with self.client() as client:
            while time.monotonic() - started < timeout_s:
                num_active = client.stats()["num_active"]
                if num_active == 0:
                    return time.monotonic() - started
                time.sleep(0.05)
        raise AssertionError(f"still {num_active} active after {timeout_s} s")
