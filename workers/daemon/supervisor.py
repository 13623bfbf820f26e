"""The daemon's main process: supervisor of the decode worker, host of the front-end.

run_daemon() creates the ring (so it outlives worker restarts; again if it was removed), starts
the worker and waits for its READY, restarts it when it dies (failing the requests it held), and on
SIGTERM/SIGINT drains: no new requests, in-flight ones finish within the grace period
or are cancelled, then everything it created is removed.
"""

import enum
import logging
import multiprocessing
import os
import signal
import socket
import time

import zmq

from cbatch.config import DaemonConfig, runtime_dir
from cbatch.errors import (
    ENDPOINT_IN_USE,
    EXIT_FAILED,
    EXIT_OK,
    INVALID_CONFIG,
    SHUTDOWN_MESSAGE,
    SHUTTING_DOWN,
    UNAVAILABLE,
    WORKER_RESTARTED,
    CbatchError,
)
from cbatch.http_api.body_limit import max_body_bytes
from cbatch.ipc.ring import SHM_DIR, RingError, create_ring
from cbatch.model import resolve_model_path, served_model_names
from cbatch.wording import counted
from cbatch.workers.daemon.crash_blame import blame_crash
from cbatch.workers.daemon.descriptors import raise_open_file_limit, warn_if_too_few_descriptors
from cbatch.workers.daemon.endpoint_lock import ipc_path, lock_endpoint, release_endpoint
from cbatch.workers.daemon.front_end import FrontEnd
from cbatch.workers.daemon.http_manager import HttpServers
from cbatch.workers.daemon.keys_reload import KeysReload
from cbatch.workers.daemon.leftovers import remove_leftovers
from cbatch.workers.daemon.progress import ProgressLog
from cbatch.workers.daemon.stop_signals import StopSignals, children_ignore_sigint_sighup
from cbatch.workers.daemon.worker_link import WorkerLink
from cbatch.workers.decode.plan import WorkerPlan
from cbatch.workers.decode.worker import run_decode_worker
from cbatch.workers.messages import WorkerStop

log = logging.getLogger("cbatch.daemon")


LOOP_POLL_MS = 100  # how often the loop looks at signals and deadlines when idle
READY_TIMEOUT_S = 600.0  # model load, including a first mmap from a cold disk
MAX_STARTUP_FAILURES = 3  # consecutive worker deaths before READY, then the daemon gives up
RESTART_BACKOFF_S = 1.0  # doubled after each consecutive start-up failure
CANCEL_GRACE_S = 5.0  # after cancelling at the end of a drain, wait this long for the finishes
STOP_TIMEOUT_S = 10.0
# What a process dies of when its own code fails (an abort, a bad access), as opposed to a kill.
CRASH_SIGNALS = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})


class DaemonState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # stop asked: no new requests; the running ones get the grace period
    CANCELLING = "cancelling"  # the grace period is over: what still runs was cancelled
    STOPPED = "stopped"


def http_servers(config: DaemonConfig, http_socket: socket.socket) -> HttpServers:
    """The HTTP server processes and the job runner beside them (--http)."""
    model_names = served_model_names(config.engine.model_path, config.aliases)
    return HttpServers(http_socket, config.endpoint, model_names, config.http_processes, config.state_dir,
                       max_body_bytes(config.engine.max_images, config.engine.max_image_bytes),
                       config.api_key, config.api_keys_file, config.batch_retention_s, config.batch_job_slice_s)


def startup_error(err: Exception, config: DaemonConfig) -> CbatchError:
    """What a failure to open the front-end's sockets tells the person starting the daemon."""
    if isinstance(err, CbatchError):
        return err
    if isinstance(err, zmq.ZMQError):
        return CbatchError(ENDPOINT_IN_USE, f"cannot listen on {config.endpoint}: {err}; pass another --endpoint")
    return CbatchError(INVALID_CONFIG, f"cannot read the CurveZMQ certificates: {err}")


class Supervisor:
    def __init__(self, config: DaemonConfig, http_socket: socket.socket | None = None):
        self.config = config
        self.stop_requested = False
        self.http = http_servers(config, http_socket) if http_socket is not None else None
        self._tag = tag = f"cbatch-{os.getpid()}"
        self._files = [os.path.join(runtime_dir(), f"{tag}-{name}.sock") for name in ("control", "tick")]
        self.control_endpoint, self.tick_endpoint = (f"ipc://{path}" for path in self._files)
        try:
            self.ring = create_ring(tag, config.ring_capacity)
        except RingError as err:
            raise CbatchError(INVALID_CONFIG, f"cannot create the token ring: {err}") from None
        self.zctx = zmq.Context()
        try:
            self.worker_link = WorkerLink(self.zctx, self.control_endpoint)
            self.frontend = FrontEnd(self.zctx, config, self.worker_link, self.ring.name, self.tick_endpoint)
            self.keys_reload = KeysReload(self.frontend.requests.ledger, self.http)
            self.frontend.stats_reply.job_runner_state = self.http and self.http.job_runner.state
        except (zmq.ZMQError, CbatchError, ValueError, OSError) as err:
            self.zctx.destroy(linger=0)
            self.ring.close()
            self.ring.unlink()
            raise startup_error(err, config) from None
        client_path = ipc_path(config.endpoint)
        if client_path:
            os.chmod(client_path, 0o600)
            self._files.append(client_path)
        self.worker: multiprocessing.Process | None = None
        self._generation = 0
        self.state = DaemonState.SERVING
        self._drain_deadline_s = 0.0  # when DRAINING turns to CANCELLING

    def _start_worker(self) -> None:
        self._generation += 1
        if not self.ring.is_linked():
            self._recreate_ring()
        plan = WorkerPlan(self.config.engine, self.control_endpoint, self.tick_endpoint, self.ring.name,
                          self._generation)
        self.worker = multiprocessing.get_context("spawn").Process(target=run_decode_worker, args=(plan,),
                                                                   name="cbatch-decode")
        self.worker_link.expect(self._generation)
        with children_ignore_sigint_sighup():
            self.worker.start()

    def _recreate_ring(self) -> None:
        """The segment was removed, so the new worker could not attach it. The new one's name
        is its generation: the WELCOME all clients get at READY names it, and they attach it."""
        name = f"{self._tag}-ring{self._generation}"
        log.warning("the token ring %s was removed from %s; creating %s", self.ring.name, SHM_DIR, name)
        try:
            ring = create_ring(name, self.config.ring_capacity)
        except RingError as err:
            raise CbatchError(INVALID_CONFIG, f"cannot create the token ring again: {err}") from None
        self.ring.close()
        self.ring.unlink()  # only forgets the registration of the removed segment
        self.ring = ring
        self.frontend.handshakes.ring_name = ring.name

    def _serve_sockets(self, timeout_ms: int, is_worker_watched: bool = True) -> bool:
        """Serve the worker's and the clients' sockets once; True if the worker process has
        exited (when it is watched: a dead worker's sentinel is ready for good)."""
        poller = zmq.Poller()
        for sock in (self.worker_link.socket, *self.frontend.client_sockets,
                     *([self.worker.sentinel] if is_worker_watched else [])):
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        disconnects, clients = self.frontend.client_sockets
        if self.worker_link.socket in ready:
            self.frontend.on_worker_messages()
        if disconnects in ready:  # before new messages, which may reuse a closed descriptor
            self.frontend.on_disconnects()
        if clients in ready:
            self.frontend.on_client_messages()
        self.frontend.flush_clients()
        return self.worker.sentinel in ready

    def _start_until_ready(self) -> None:
        """Start workers until one reports READY; give up after repeated start-up deaths,
        or at once when the worker says a setting is wrong (a model that does not load)."""
        for attempt in range(MAX_STARTUP_FAILURES):
            if attempt:  # clients are answered meanwhile ("starting"), and held submits wait
                backoff_ends_s = time.monotonic() + RESTART_BACKOFF_S * 2 ** (attempt - 1)
                while time.monotonic() < backoff_ends_s and not self.stop_requested:
                    self._serve_sockets(LOOP_POLL_MS, is_worker_watched=False)
            self._start_worker()
            deadline = time.monotonic() + READY_TIMEOUT_S
            while self.worker_link.ready is None and time.monotonic() < deadline and not self.stop_requested:
                if self._serve_sockets(LOOP_POLL_MS):
                    self.worker.join()
                    break
            failure = self.worker_link.failure
            if self.worker_link.ready is not None or self.stop_requested:
                return
            if failure is not None and failure.code == INVALID_CONFIG:
                raise CbatchError(INVALID_CONFIG, failure.message)  # the same settings fail again
            if self.worker.is_alive():
                self.worker.kill()
                self.worker.join()
        failure = self.worker_link.failure
        reason = failure.message if failure is not None else f"exit code {self.worker.exitcode}"
        raise CbatchError(WORKER_RESTARTED, f"the decode worker failed to start {MAX_STARTUP_FAILURES} times: {reason}")

    def serve(self) -> None:
        if self.http is not None:  # it answers 503 until the model has loaded
            self.http.start()
        log.info("cbatch-worker: loading %s on %s (clients may connect now; they wait for the model)",
                 served_model_names(self.config.engine.model_path)[0], self.config.endpoint)
        self._start_until_ready()
        if self.stop_requested:
            return
        ready = self.worker_link.ready
        log.info("cbatch-worker ready: model %s, parallel %d, context %d per sequence, prefix cache %s, %d threads, "
                 "endpoint %s, ring %s, worker pid %d", ready.model, self.config.engine.parallel, ready.ctx_per_seq,
                 ready.prefix_cache, self.config.engine.num_threads, self.config.endpoint, self.ring.name, ready.pid)
        progress = ProgressLog(self.config.progress_interval_s)
        while self.state is not DaemonState.STOPPED:
            progress.update(time.monotonic(), self.frontend.num_in_flight, self.worker_link.stats,
                            self.frontend.num_ended)
            self.keys_reload.poll()
            if self.http is not None and self.state is DaemonState.SERVING:
                self.http.poll()
            if self._serve_sockets(LOOP_POLL_MS):
                self._on_worker_exit()
            elif self._is_hung():
                log.warning("decode worker made no step for %.0f s; killing it", self.config.worker_timeout_s)
                self.worker.kill()  # the next round sees it gone and takes the restart path
            else:
                self._advance_drain(time.monotonic())

    def _on_worker_exit(self) -> None:
        """The requests it held fail; a serving daemon starts another worker."""
        self.worker.join()
        self._quarantine_culprits()
        self.frontend.fail_all(WORKER_RESTARTED, f"the decode worker died (exit code {self.worker.exitcode}); "
                                                 "the request was lost, submit it again", include_held=False)
        if self.state is not DaemonState.SERVING:
            self.state = DaemonState.STOPPED
            return
        log.warning("decode worker died (exit code %s); restarting", self.worker.exitcode)
        self._start_until_ready()

    def _quarantine_culprits(self) -> None:
        """A crash is blamed on the requests the worker marked in the ring (crash_blame.py); a
        worker killed (SIGKILL, the watchdog's too, or SIGTERM) crashed on nothing."""
        marks = self.ring.take_crash_marks()
        if -(self.worker.exitcode or 0) in CRASH_SIGNALS:
            blame_crash(marks, self.frontend)

    def _advance_drain(self, now_s: float) -> None:
        """SERVING -> DRAINING on a stop request: no new requests, the HTTP servers drain;
        DRAINING -> CANCELLING when the grace period is over: what runs is cancelled;
        -> STOPPED once nothing is in flight, or CANCEL_GRACE_S after the cancel."""
        if self.state is DaemonState.SERVING:
            if not self.stop_requested:
                return
            log.info("draining: %s in flight, grace %.0f s", counted(self.frontend.num_in_flight, "request"),
                     self.config.drain_grace_s)
            self.frontend.start_draining()
            if self.http is not None:
                self.http.drain()
            self._drain_deadline_s = now_s + self.config.drain_grace_s
            self.state = DaemonState.DRAINING
        if not self.frontend.num_in_flight:
            self.state = DaemonState.STOPPED
        elif self.state is DaemonState.DRAINING and now_s > self._drain_deadline_s:
            log.info("drain grace over: %s end unfinished, with shutting_down (callers may send them again)",
                     counted(self.frontend.num_in_flight, "request"))
            self.frontend.cancel_all()
            self.state = DaemonState.CANCELLING
        elif self.state is DaemonState.CANCELLING and now_s > self._drain_deadline_s + CANCEL_GRACE_S:
            self.frontend.fail_all(SHUTTING_DOWN, SHUTDOWN_MESSAGE)
            self.state = DaemonState.STOPPED

    def _is_hung(self) -> bool:
        """The worker stamps the ring after every step and every idle wake-up."""
        timeout_s = self.config.worker_timeout_s
        if not timeout_s or self.worker_link.ready is None:
            return False
        return (time.monotonic_ns() - self.ring.heartbeat_ns) / 1e9 > timeout_s

    def close(self) -> None:
        if self.http is not None:
            self.http.stop()  # its last responses end before the daemon stops answering
        self.frontend.fail_all(UNAVAILABLE, "the cbatch daemon stopped")
        if self.worker is not None and self.worker.is_alive():
            if self.worker_link.ready is not None:  # it runs its loop: ask it to leave and clean up
                self.worker_link.send(WorkerStop())
                self.worker.join(STOP_TIMEOUT_S)
            if self.worker.is_alive():  # still loading the model, or stuck
                self.worker.kill()
                self.worker.join()
        self.frontend.close()
        self.worker_link.close()
        self.zctx.term()
        self.ring.close()
        self.ring.unlink()
        for path in self._files:
            if os.path.exists(path):
                os.unlink(path)


def run_daemon(config: DaemonConfig, http_socket: socket.socket | None = None, lock_fd: int | None = None) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code. `http_socket`, bound by
    the caller, is served by the OpenAI-compatible HTTP server; `lock_fd` is the endpoint's
    lock when the caller took it (endpoint_lock.py), released here."""
    stop_signals = StopSignals()  # first: a stop while it starts still removes what it made
    raise_open_file_limit()
    warn_if_too_few_descriptors(config)
    supervisor = None
    try:  # every mistake a user can make ends here as one line and exit code 1
        if lock_fd is None:
            lock_fd = lock_endpoint(config.endpoint)  # first: a second daemon fails at once
        resolve_model_path(config.engine.model_path)  # a wrong --model fails now, not in a worker
        removed = remove_leftovers(runtime_dir())
        if removed:
            log.info("removed %s left by daemons that are no longer running", counted(len(removed), "file"))
        supervisor = Supervisor(config, http_socket)
        stop_signals.notify(supervisor)
        supervisor.serve()
        log.info("cbatch-worker stopped")
        return EXIT_OK
    except CbatchError as err:
        log.error("cbatch-worker: %s", err.message)
        return EXIT_FAILED
    finally:
        if supervisor is not None:
            supervisor.close()
        release_endpoint(config.endpoint, lock_fd)
        stop_signals.ignore()
