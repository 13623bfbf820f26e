"""The HTTP server process as the supervisor sees it: started once the worker is ready,
restarted if it dies, drained with SIGTERM when the daemon drains, killed if it lingers.

The server (cbatch/http_server.py) is a separate process so that its event loop and
JSON work never delay the front-end's poll loop; it reaches the daemon as any local
client does.
"""

import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("cbatch.worker")

RESTART_BACKOFF_S = 1.0  # a server that dies at once is not restarted in a tight loop
STOP_TIMEOUT_S = 10.0  # after the daemon drained, the server's last responses get this long


class HttpProcess:
    def __init__(self, host: str, port: int, endpoint: str, model_id: str):
        self.host, self.port, self.endpoint, self.model_id = host, port, endpoint, model_id
        self.process: subprocess.Popen | None = None
        self._started_s = 0.0
        self.num_restarts = 0

    def start(self) -> None:
        self._started_s = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-m", "cbatch.http_server", "--endpoint", self.endpoint,
                                         "--host", self.host, "--port", str(self.port), "--model-id", self.model_id,
                                         "--parent-pid", str(os.getpid())])
        log.info("cbatch http: serving http://%s:%d (pid %d)", self.host, self.port, self.process.pid)

    def poll(self) -> None:
        """Restart a server that died (not while the daemon drains: see drain())."""
        if self.process is None or self.process.poll() is None:
            return
        if time.monotonic() - self._started_s < RESTART_BACKOFF_S:
            return
        log.warning("cbatch http: server exited (code %s); restarting", self.process.returncode)
        self.num_restarts += 1
        self.start()

    def drain(self) -> None:
        """New requests get 503, in-flight responses finish; the process then exits by itself."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.process is None:
            return
        self.drain()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None
