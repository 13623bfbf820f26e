"""The HTTP server process as the supervisor sees it: started before the model loads (it
answers 503 until the daemon is ready), restarted if it dies, drained with SIGTERM when
the daemon drains, killed if it lingers.

The server (cbatch/http_server.py) is a separate process so that its event loop and
JSON work never delay the front-end's poll loop; it reaches the daemon as any local
client does. The listening socket is bound once, by the daemon, and handed to each
server process: a taken port fails the daemon's start instead of every restart, and
connections that arrive while a server restarts wait in the backlog.
"""

import logging
import signal
import socket
import subprocess
import sys
import time

from cbatch.errors import CbatchError, ENDPOINT_IN_USE

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


class HttpProcess:
    def __init__(self, sock: socket.socket, endpoint: str, model_id: str):
        self.sock, self.endpoint, self.model_id = sock, endpoint, model_id
        self.host, self.port = sock.getsockname()[:2]
        self.process: subprocess.Popen | None = None
        self._started_s = 0.0
        self._died_s: float | None = None
        self.num_quick_deaths = 0
        self.num_restarts = 0

    def start(self) -> None:
        self._started_s, self._died_s = time.monotonic(), None
        fd = self.sock.fileno()
        self.process = subprocess.Popen([sys.executable, "-m", "cbatch.http_api.app", "--endpoint", self.endpoint,
                                         "--fd", str(fd), "--model-id", self.model_id], pass_fds=(fd,))
        log.info("cbatch http: serving http://%s:%d (pid %d)", self.host, self.port, self.process.pid)

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
                log.error("cbatch http: server exited (code %s), %d times in a row within %.0f s of its start; "
                          "no longer serving HTTP (ZeroMQ clients are still served)",
                          self.process.returncode, self.num_quick_deaths, QUICK_DEATH_S)
                self.process = None
                self.sock.close()  # HTTP clients get "connection refused" instead of waiting in the backlog
                return
            log.warning("cbatch http: server exited (code %s); restarting", self.process.returncode)
        if now - self._died_s >= RESTART_BACKOFF_S * 2 ** max(self.num_quick_deaths - 1, 0):
            self.num_restarts += 1
            self.start()

    def drain(self) -> None:
        """New requests get 503, in-flight responses finish; the process then exits by itself.
        The daemon's copy of the socket closes, so the port stops taking connections once
        the server's copy closes too."""
        self.sock.close()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

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
