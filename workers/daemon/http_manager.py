"""The HTTP server processes as the supervisor sees them: started before the model loads
(they answer 503 until the daemon is ready), each restarted if it dies, drained with
SIGTERM when the daemon drains, killed if they linger.

A server (cbatch/http_api/app.py) is a separate process so that its event loop and JSON
work never delay the front-end's poll loop; it reaches the daemon as any local client
does. Several serve one port when one cannot keep up (`--http-processes`): the listening
socket is bound once, by the daemon, and every server process accepts from that same
socket, as a pre-forking web server's workers do. A taken port fails the daemon's start
instead of every restart; connections that arrive while a server restarts wait in the
backlog or go to the others; and the kernel wakes whichever process is free to accept,
so a busy one takes fewer. (Separate sockets with SO_REUSEPORT would hash connections
to processes whatever their load, and refuse those hashed to one that is restarting.)
"""

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from cbatch.config import runtime_dir
from cbatch.http_api.auth import API_KEY_ENV, API_KEYS_FILE_ENV
from cbatch.errors import CbatchError, ENDPOINT_IN_USE
from cbatch.workers.daemon.stop_signals import children_ignore_sigint_sighup

log = logging.getLogger("cbatch.daemon.http")

RESTART_BACKOFF_S = 0.5  # before the first restart; doubled after each further quick death
QUICK_DEATH_S = 30.0  # a server that dies sooner than this after its start did not get going
MAX_QUICK_DEATHS = 5  # in a row, then the daemon stops restarting it
STOP_TIMEOUT_S = 10.0  # after the daemon drained, the server's last responses get this long


def listen_http(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, or a CbatchError saying why the address cannot be used."""
    sock = None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT leftovers are fine
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as err:
        if sock is not None:
            sock.close()
        raise CbatchError(ENDPOINT_IN_USE, f"cannot listen on http://{host}:{port}: {err.strerror}; "
                                           "pass another --http port") from None
    sock.set_inheritable(True)
    return sock


class HttpServers:
    """The daemon's HTTP server processes, all on its one listening socket."""

    def __init__(self, sock: socket.socket, endpoint: str, model_names: list[str], num_processes: int, api_key: str = "",
                 api_keys_file: str = ""):
        self.sock = sock
        env = {**os.environ, API_KEY_ENV: api_key} if api_key else None
        if api_keys_file:  # each server reads the file itself, and again on SIGHUP (reload)
            env = {**os.environ, API_KEYS_FILE_ENV: os.path.abspath(api_keys_file)}
        self.metrics_dir = None
        if num_processes > 1:
            # Several processes count HTTP metrics: each writes its counters to files here
            # (prometheus_client's multiprocess mode) and a scrape of any sums them all.
            self.metrics_dir = os.path.join(runtime_dir(), f"cbatch-{os.getpid()}-http-metrics")
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            os.makedirs(self.metrics_dir, mode=0o700)
            env = {**(env or os.environ), "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        self.processes = [HttpProcess(sock, endpoint, model_names, i, env) for i in range(num_processes)]

    def start(self) -> None:
        for process in self.processes:
            process.start()

    def poll(self) -> None:
        for process in self.processes:
            process.poll()
        if all(process.is_given_up for process in self.processes) and self.sock.fileno() != -1:
            log.error("cbatch http: no longer serving HTTP (ZeroMQ clients are still served)")
            self.sock.close()  # HTTP clients get "connection refused" instead of waiting in the backlog

    def reload(self) -> None:
        """The keys file changed: each server reads it again (its requests in flight run on)."""
        for process in self.processes:
            process.send(signal.SIGHUP)

    def drain(self) -> None:
        """New requests get 503, in-flight responses finish; each process then exits by
        itself. The daemon's copy of the socket closes, so the port stops taking
        connections once the servers' copies close too."""
        self.sock.close()
        for process in self.processes:
            process.drain()

    def stop(self) -> None:
        self.drain()
        for process in self.processes:
            process.stop()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)


class HttpProcess:
    """One server process on the daemon's listening socket (which it does not own)."""

    def __init__(self, sock: socket.socket, endpoint: str, model_names: list[str], number: int, env: dict | None):
        self.sock, self.endpoint, self.model_names, self.number = sock, endpoint, model_names, number
        self.env = env  # None: the daemon's own
        self.host, self.port = sock.getsockname()[:2]
        self.process: subprocess.Popen | None = None
        self._started_s = 0.0
        self._died_s: float | None = None
        self.num_quick_deaths = 0
        self.num_restarts = 0
        self.is_given_up = False  # it kept dying at once, and is not restarted again

    def start(self) -> None:
        self._started_s, self._died_s = time.monotonic(), None
        fd = self.sock.fileno()
        names = [arg for name in self.model_names for arg in ("--model-id", name)]
        with children_ignore_sigint_sighup():
            self.process = subprocess.Popen([sys.executable, "-m", "cbatch.http_api.app", "--endpoint", self.endpoint,
                                             "--fd", str(fd), *names], pass_fds=(fd,), env=self.env)
        log.info("cbatch http: serving http://%s:%d (server %d, pid %d)", self.host, self.port, self.number,
                 self.process.pid)

    def poll(self) -> None:
        """Restart a server that died (not while the daemon drains: see drain()), after a
        back-off that grows while it keeps dying at once; give up after MAX_QUICK_DEATHS."""
        if self.process is None or self.process.poll() is None:
            return
        now = time.monotonic()
        if self._died_s is None:
            self._died_s = now
            is_quick = now - self._started_s < QUICK_DEATH_S
            self.num_quick_deaths = self.num_quick_deaths + 1 if is_quick else 0
            if self.num_quick_deaths >= MAX_QUICK_DEATHS:
                log.error("cbatch http: server %d exited (code %s), %d times in a row within %.0f s of its "
                          "start; it is not restarted again",
                          self.number, self.process.returncode, self.num_quick_deaths, QUICK_DEATH_S)
                self.process, self.is_given_up = None, True
                return
            log.warning("cbatch http: server %d exited (code %s); restarting", self.number, self.process.returncode)
        if now - self._died_s >= RESTART_BACKOFF_S * 2 ** max(self.num_quick_deaths - 1, 0):
            self.num_restarts += 1
            self.start()

    def send(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def drain(self) -> None:
        self.send(signal.SIGTERM)

    def stop(self) -> None:
        self.drain()
        if self.process is None:
            return
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None
