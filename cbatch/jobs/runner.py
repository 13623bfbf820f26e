"""The batch job runner: one process beside the HTTP servers (started, restarted and
drained by the daemon's supervisor), and the only one that runs jobs, however many HTTP
processes take them: they only write the state directory, which this process scans.

It is one more client of the daemon. Jobs run one at a time, oldest first, each with up to
DEFAULT_MAX_IN_FLIGHT requests outstanding (or the daemon's --parallel, where that is
more) at batch priority, so interactive requests go first. A watcher thread stops the running job (KeyboardInterrupt in the main thread, as
Ctrl-C stops cbatch-submit: outstanding requests are cancelled, finished lines are kept)
when it is cancelled or its window ends, and the whole process when it is told to drain
(SIGTERM) or the daemon that started it is gone. One runner per state directory: a
second daemon on the same directory waits for the lock and leaves its jobs to the first.
"""

import argparse
import contextlib
import errno
import fcntl
import logging
import os
import signal
import threading
import time

from cbatch.client import Client
from cbatch.errors import CbatchError
from cbatch.jobs.batches import FINAL_STATUSES, BatchStore
from cbatch.jobs.job_run import JobRun
from cbatch.jobs.state_dir import RUNNER_LOCK

log = logging.getLogger("cbatch.jobs")

POLL_S = 0.25  # how often the state directory is scanned for new jobs while none runs
WATCH_S = 0.1  # how often the watcher looks at the running job's cancel marker and the parent
DISK_FULL_RETRY_S = 5.0  # a job the full disk stopped is tried again no sooner than this
WAITING_CHECK_S = 1.0  # how often the watcher looks for waiting jobs cancelled or past their window


class Runner:
    def __init__(self, endpoint: str, state_dir: str):
        self.endpoint = endpoint
        self.state_dir = state_dir
        self.store = BatchStore(state_dir)
        self.parent_pid = os.getppid()
        self.is_stopping = False  # SIGTERM, or the daemon is gone
        self.running_id: str | None = None
        self._ended_ids: set[str] = set()
        self._is_interruptible = False
        self._lock = threading.Lock()
        # Held while the main thread picks its next job and while the watcher expires a
        # waiting one, so that the two never take the same job.
        self._claim_lock = threading.Lock()

    def _should_stop_run(self) -> bool:
        if os.getppid() != self.parent_pid:
            self.is_stopping = True
        if self.is_stopping:
            return True
        batch = self.store.stored(self.running_id) if self.running_id else None
        return batch is not None and (self.store.cancel_asked_at(self.running_id) is not None
                                      or time.time() >= batch["expires_at"])

    def _watch(self) -> None:
        waiting_checked_s = 0.0
        while True:
            time.sleep(WATCH_S)
            with self._lock:
                if self._is_interruptible and self._should_stop_run():
                    os.kill(os.getpid(), signal.SIGUSR1)  # interrupt(), in the main thread, which runs the job
            if time.monotonic() - waiting_checked_s >= WAITING_CHECK_S:
                waiting_checked_s = time.monotonic()
                self._end_waiting()

    def _end_waiting(self) -> None:
        """Jobs wait while another runs: one cancelled, or whose window ends, meanwhile ends
        now (`expired` with an error line for each of its requests), not when the runner
        reaches it."""
        for batch_id in self._pending_ids():
            with self._claim_lock:  # never the job the main thread runs or is about to
                if batch_id == self.running_id:
                    continue
                try:
                    if JobRun(self.store, batch_id, None, {}, self.interruptible).end_waiting():
                        self._ended_ids.add(batch_id)
                except Exception:  # the main thread's run of it will fail it with the reason
                    log.exception("cbatch jobs: %s could not be ended", batch_id)

    def interrupt(self, signum, frame) -> None:
        """SIGUSR1's handler: stops the job's run, once, and only within interruptible()."""
        if self._is_interruptible:
            self._is_interruptible = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def interruptible(self):
        with self._lock:
            self._is_interruptible = True
        try:
            yield
        finally:
            with self._lock:
                self._is_interruptible = False

    def _pending_ids(self) -> list[str]:
        """The jobs not ended, oldest first (an ended job never changes: it is not read again)."""
        batches = [self.store.stored(batch_id) for batch_id in self.store.ids() if batch_id not in self._ended_ids]
        self._ended_ids.update(b["id"] for b in batches if b is not None and b["status"] in FINAL_STATUSES)
        return [b["id"] for b in sorted((b for b in batches if b is not None and b["id"] not in self._ended_ids),
                                        key=lambda b: (b["created_at"], b["id"]))]

    def _on_os_error(self, job: JobRun, batch_id: str, err: OSError) -> bool:
        """A full disk pauses the job (its log holds only whole lines: it goes on from them
        once there is room, DISK_FULL_RETRY_S later at the soonest); any other error fails it."""
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            log.exception("cbatch jobs: %s failed", batch_id)
            job.fail("internal", f"the job runner failed on this job ({type(err).__name__}: {err}); "
                                 "its finished lines are kept")
            return False
        log.error("cbatch jobs: %s waits: the state directory's disk is full (%s); it goes on from its finished "
                  "lines once there is room", batch_id, err.strerror)
        retry_at_s = time.monotonic() + DISK_FULL_RETRY_S
        self._wait(lambda: time.monotonic() >= retry_at_s)
        return False

    def _wait(self, is_done) -> None:
        while not is_done() and not self.is_stopping:
            if os.getppid() != self.parent_pid:
                self.is_stopping = True
            time.sleep(POLL_S)

    def _lock_state_dir(self):
        lock_file = open(os.path.join(self.state_dir, RUNNER_LOCK), "a")
        def is_locked() -> bool:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False
        if not is_locked():
            log.warning("cbatch jobs: another daemon runs the batches of %s; this one's wait for it to stop",
                        self.state_dir)
            self._wait(is_locked)
        return lock_file

    def _connect(self) -> tuple[Client | None, dict]:
        """A client of the daemon once its model is loaded, and its health then."""
        client = None
        def is_ready() -> bool:
            nonlocal client
            try:
                client = client or Client(self.endpoint)
                return client.health()["status"] == "ok"
            except CbatchError:
                return False
        self._wait(is_ready)
        return client, (client.health() if client is not None and not self.is_stopping else {})

    def serve(self) -> None:
        threading.Thread(target=self._watch, daemon=True).start()
        lock_file = self._lock_state_dir()
        client, health = self._connect()
        try:
            while not self.is_stopping:
                pending_ids = self._pending_ids()
                for batch_id in pending_ids:
                    with self._claim_lock:
                        self.running_id = batch_id
                    job = JobRun(self.store, batch_id, client, health, self.interruptible)
                    try:
                        is_done = job.run()
                    except KeyboardInterrupt:  # stopped outside the lines' run: the job is as it was
                        is_done = False
                    except OSError as err:
                        is_done = self._on_os_error(job, batch_id, err)
                    except Exception as err:  # what no line's check foresaw fails this job, not the runner
                        log.exception("cbatch jobs: %s failed", batch_id)
                        job.fail("internal", f"the job runner failed on this job ({type(err).__name__}: {err}); "
                                             "its finished lines are kept")
                        is_done = False  # a fresh client for the next job: this one may hold the run's streams
                    self.running_id = None
                    if self.is_stopping:
                        break
                    if not is_done:  # refused for too long, or cut short: a new client, a fresh start
                        client.close()
                        client, health = self._connect()
                if not pending_ids:
                    self._wait(lambda: bool(self._pending_ids()))
        finally:
            if client is not None:
                client.close()
            lock_file.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="cbatch-jobs")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runner = Runner(args.endpoint, args.state_dir)

    def stop(signum, frame):
        runner.is_stopping = True  # the watcher interrupts a running job

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which drains us with SIGTERM
    signal.signal(signal.SIGUSR1, runner.interrupt)
    runner.serve()


if __name__ == "__main__":
    main()
