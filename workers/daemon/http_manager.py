"""The HTTP server processes as the supervisor sees them: started before the model loads
(they answer 503 until the daemon is ready), each restarted if it dies, drained with
SIGTERM when the daemon drains, killed if they linger (child_process). Beside them, the
batch job runner, which runs the jobs they take (cbatch.jobs.job_runner), kept the same way.

A server (cbatch/http_api/server.py) is a separate process so that its event loop and JSON
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

from cbatch.config import runtime_dir
from cbatch.errors import ENDPOINT_IN_USE, CbatchError
from cbatch.http_api.auth import API_KEY_ENV, API_KEYS_FILE_ENV
from cbatch.workers.daemon.child_process import ChildProcess, module_argv

log = logging.getLogger("cbatch.daemon.http")


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
    """The daemon's HTTP server processes, all on its one listening socket, and the job
    runner that runs the batches they take (both read and write `state_dir`)."""

    def __init__(self, sock: socket.socket, endpoint: str, model_names: list[str], num_processes: int,
                 state_dir: str, max_body_bytes: int, api_key: str = "", api_keys_file: str = "",
                 batch_retention_s: float = 0.0, batch_job_slice_s: float = 60.0):
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
        self.processes = [HttpProcess(sock, endpoint, model_names, i, env, state_dir, max_body_bytes)
                          for i in range(num_processes)]
        self.job_runner = JobRunnerProcess(endpoint, state_dir, batch_retention_s, batch_job_slice_s)

    def start(self) -> None:
        for process in self.processes:
            process.start()
        self.job_runner.start()

    def poll(self) -> None:
        for process in self.processes:
            process.poll()
        self.job_runner.poll()
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
        self.job_runner.drain()  # finished lines are kept; a restarted daemon goes on from them

    def stop(self) -> None:
        self.drain()
        for process in [*self.processes, self.job_runner]:
            process.stop()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)


class HttpProcess(ChildProcess):
    """One server process on the daemon's listening socket (which it does not own)."""

    def __init__(self, sock: socket.socket, endpoint: str, model_names: list[str], number: int, env: dict | None,
                 state_dir: str, max_body_bytes: int):
        super().__init__(log, env)
        self.sock, self.endpoint, self.model_names, self.number = sock, endpoint, model_names, number
        self.state_dir, self.max_body_bytes = state_dir, max_body_bytes
        self.host, self.port = sock.getsockname()[:2]
        self.title = f"cbatch http: server {number}"

    def argv(self) -> list[str]:
        self.pass_fds = (self.sock.fileno(),)
        names = [arg for name in self.model_names for arg in ("--model-id", name)]
        return module_argv("cbatch.http_api.server", "--endpoint", self.endpoint, "--fd", str(self.sock.fileno()),
                           "--state-dir", self.state_dir, "--max-body-bytes", str(self.max_body_bytes), *names)

    def start(self) -> None:
        super().start()
        log.info("cbatch http: serving http://%s:%d (server %d, pid %d)", self.host, self.port, self.number,
                 self.process.pid)


class JobRunnerProcess(ChildProcess):
    """The one process that runs the batch jobs the HTTP servers take (cbatch.jobs.job_runner)."""

    title = "cbatch jobs: the batch job runner"
    # Never given up: without it every job of every tenant would wait unseen. Each job's
    # own failures fail that job (cbatch.jobs.job_runner); a runner that keeps dying at once
    # says so in the log, /health, cbatch-status and /metrics while it is restarted.
    max_quick_deaths = None

    def __init__(self, endpoint: str, state_dir: str, retention_s: float, slice_s: float):
        super().__init__(log, None)
        self.endpoint, self.state_dir, self.retention_s, self.slice_s = endpoint, state_dir, retention_s, slice_s

    def argv(self) -> list[str]:
        return module_argv("cbatch.jobs.job_runner", "--endpoint", self.endpoint, "--state-dir", self.state_dir,
                           "--retention-s", str(self.retention_s), "--slice-s", str(self.slice_s))
