"""Several cbatch daemons behind the smg router, as docs/scale-out.md runs them, for the
scale-out tests.

Each daemon is a host of its own: a network namespace joined to this one by a veth pair,
with addresses the test assigns from 198.18.0.0/15 (the range set aside for network
tests), the daemon listening on the same port in each, as on separate machines. Where
namespaces cannot be made (no privilege), each daemon gets a loopback address of its own
(127.0.0.2, 127.0.0.3, ...) instead; `HOSTS_KIND` says which the run used.
"""

import os
import subprocess
import time

import httpx
from common import free_port
from daemonkit import SCRIPTS_DIR, stop_process
from httpkit import HttpDaemon

HOST_PORT = 8000
API_KEY = "scale-out-test-key"
# What docs/scale-out.md tunes: a dead daemon is left out after two failed checks a
# second apart, a restarted one taken back after one good check, and no circuit breaker
# (it shunned a restarted daemon for 60 s after its drain's 503s).
HEALTH_FLAGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                "--health-success-threshold", "1", "--health-check-timeout-secs", "1", "--disable-circuit-breaker")
ROUTER_READY_TIMEOUT_S = 60.0
ROUTER_STOP_TIMEOUT_S = 30.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _namespaces_work() -> bool:
    probe = f"cbt{os.getpid()}p"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError):
        return False
    _ip("netns", "del", probe)
    return True


HOSTS_KIND = "network namespaces" if _namespaces_work() else "loopback addresses"


class Host:
    """Where one daemon runs: `address` is how this namespace (and the router) reaches it,
    `prefix` the command that runs a program there."""

    def __init__(self, index: int):
        self.netns = None
        if HOSTS_KIND == "loopback addresses":
            self.address, self.prefix, self.port = f"127.0.0.{2 + index}", (), free_port()
            return
        # one /30 per host: .1 on this side, .2 in the namespace; the third octet from the
        # pid keeps two test runs on one machine apart
        subnet = f"198.18.{os.getpid() & 0xFF}.{4 * index}"
        base = subnet.rsplit(".", 1)[0]
        near, self.address = f"{base}.{4 * index + 1}", f"{base}.{4 * index + 2}"
        self.netns, self.port = f"cbt{os.getpid()}h{index}", HOST_PORT
        near_link, far_link = f"cb{os.getpid()}a{index}", f"cb{os.getpid()}b{index}"
        _ip("netns", "add", self.netns)
        try:
            _ip("link", "add", near_link, "type", "veth", "peer", "name", far_link, "netns", self.netns)
            _ip("addr", "add", f"{near}/30", "dev", near_link)
            _ip("link", "set", near_link, "up")
            for args in (("addr", "add", f"{self.address}/30", "dev", far_link), ("link", "set", far_link, "up"),
                         ("link", "set", "lo", "up")):
                _ip("-n", self.netns, *args)
        except BaseException:
            self.close()
            raise
        self.prefix = ("ip", "netns", "exec", self.netns)

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def start_daemon(self, model_path: str, *args: str, **options) -> HttpDaemon:
        """A daemon of this host, serving HTTP beyond loopback (so it requires the key)."""
        return HttpDaemon(model_path, "--allow-remote", "--api-key", API_KEY, "--threads", "1", *args,
                          host=self.address, port=self.port, prefix=self.prefix, **options)

    def close(self) -> None:
        """Removing the namespace removes its end of the veth pair, and so the pair."""
        if self.netns is not None:
            _ip("netns", "del", self.netns)
            self.netns = None


class Router:
    """`smg launch` in front of the given daemons, on a free loopback port."""

    def __init__(self, worker_urls: list[str], workdir, *, policy: str = "cache_aware", extra: tuple = ()):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"smg-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [str(SCRIPTS_DIR / "smg"), "launch", "--host", "127.0.0.1", "--port", str(self.port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-urls", *worker_urls, "--policy", policy, *HEALTH_FLAGS, "--api-key", API_KEY,
             "--log-level", "warn", *extra],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_healthy(len(worker_urls), ROUTER_READY_TIMEOUT_S)

    def log(self) -> str:
        return self.log_path.read_text()

    def health_of_workers(self) -> dict[str, bool]:
        """Worker URL -> whether the router now sends it requests."""
        reply = httpx.get(f"{self.base_url}/workers", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=5)
        reply.raise_for_status()
        return {worker["url"]: worker["is_healthy"] for worker in reply.json()["workers"]}

    def wait_healthy(self, num_workers: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"smg exited {self.process.returncode}: {self.log()}"
            try:
                health = self.health_of_workers()
            except httpx.HTTPError:
                health = {}  # not listening yet
            if len(health) == num_workers and all(health.values()):
                return
            time.sleep(0.1)
        raise AssertionError(f"smg did not see {num_workers} healthy workers: {self.log()}")

    def openai(self, **options):
        import openai

        return openai.OpenAI(**{"base_url": f"{self.base_url}/v1", "api_key": API_KEY, "max_retries": 0, **options})

    def stop(self) -> int:
        code = stop_process(self.process, timeout_s=ROUTER_STOP_TIMEOUT_S)
        self._log.close()
        return code
