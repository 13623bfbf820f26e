"""The batch job runner: one process beside the HTTP servers (started, restarted and
drained by the daemon's supervisor), and the only one that runs jobs, however many HTTP
processes take them: they only write the state directory, which this process scans.

Jobs run side by side, one per tenant (the tenant of the API key that created the job;
jobs made without keys are all one tenant's), each tenant's oldest first, up to
MAX_RUNNING_JOBS at once. Past that, tenants take turns: the tenants whose jobs ran least
lately go first (one never run, the oldest job first), and while one waits, the job that
has run longest, once past its slice (--batch-job-slice), stops between two arrivals and
goes on later from its finished lines (the lines it had in flight are sent again then).
So a tenant's 50,000-line job never holds another tenant's job past its window, however
many tenants there are, and the daemon divides the slots between the jobs' lines as it
divides them between live requests (--fair-share weighs each tenant's tokens).

Each running job has a thread and a client of the daemon of its own, with up to
DEFAULT_MAX_IN_FLIGHT requests outstanding (or the daemon's --parallel, where that is
more) at batch priority, so interactive requests go first. A run stops between two
arrivals (its outstanding requests cancelled, its finished lines kept) when the job is
cancelled, its window ends, or the runner drains (SIGTERM, or the daemon that started it
is gone). One runner per state directory: a second daemon on the same directory waits
for the lock and leaves its jobs to the first.
"""

import argparse
import errno
import fcntl
import logging
import math
import os
import signal
import threading
import time

from cbatch.client import Client
from cbatch.errors import CbatchError
from cbatch.jobs.batches import FINAL_STATUSES, BatchStore
from cbatch.jobs.files import OWNER
from cbatch.jobs.job_run import JobRun
from cbatch.jobs.retention import RETENTION_CHECK_S, let_go
from cbatch.jobs.state_dir import RUNNER_LOCK

log = logging.getLogger("cbatch.jobs")

POLL_S = 0.25  # how often the state directory is scanned for jobs to start
MAX_RUNNING_JOBS = 8  # jobs (so tenants) run at once: each holds a client and its requests in flight
PAUSED_RETRY_S = 1.0  # a job that stopped unfinished (the daemon refused past the patience) is taken again after
DISK_FULL_RETRY_S = 5.0  # a job the full disk stopped is tried again no sooner than this
WAITING_CHECK_S = 1.0  # how often waiting jobs are looked at for a cancel or their window's end


class JobRunner:
    def __init__(self, endpoint: str, state_dir: str, retention_s: float = 0.0, slice_s: float = 60.0):
        self.endpoint = endpoint
        self.state_dir = state_dir
        self.retention_s = retention_s  # ended jobs are removed this long after they ended (0: kept)
        self.slice_s = slice_s  # a job runs at least this long before it gives its place to a waiting tenant's
        self.store = BatchStore(state_dir)
        self.parent_pid = os.getppid()
        self.is_stopping = False  # SIGTERM, or the daemon is gone
        self._running: dict[str, threading.Thread] = {}  # batch id -> the thread running it
        self._running_tenants: dict[str, str | None] = {}  # batch id -> its tenant
        self._retry_at_s: dict[str, float] = {}  # batch id -> when a job that stopped unfinished may run again
        self._started_s: dict[str, float] = {}  # batch id -> when its current run started
        self._last_turn_s: dict[str | None, float] = {}  # tenant -> when its last run started
        self._yielding: set[str] = set()  # batch ids asked to give their place back (read by their threads)
        self._yielded_s: dict[str | None, float] = {}  # tenant -> when its job last gave its place back
        self._ended_ids: set[str] = set()

    def _is_parent_gone(self) -> bool:
        if os.getppid() != self.parent_pid:
            self.is_stopping = True
        return self.is_stopping

    def _pending(self) -> list[dict]:
        """The jobs not ended, oldest first (an ended job never changes: it is not read again)."""
        batches = [self.store.stored(batch_id) for batch_id in self.store.ids() if batch_id not in self._ended_ids]
        self._ended_ids.update(b["id"] for b in batches if b is not None and b["status"] in FINAL_STATUSES)
        return sorted((b for b in batches if b is not None and b["id"] not in self._ended_ids),
                      key=lambda b: (b["created_at"], b["id"]))

    def _end_waiting(self, pending: list[dict]) -> None:
        """Jobs wait while others run: one cancelled, or whose window ends, meanwhile ends
        now (`expired` with an error line for each of its requests), not when its turn comes."""
        for batch in pending:
            if batch["id"] in self._running:
                continue
            try:
                if JobRun(self.store, batch["id"]).end_waiting():
                    self._ended_ids.add(batch["id"])
            except Exception:  # its run will fail it with the reason
                log.exception("cbatch jobs: %s could not be ended", batch["id"])

    def _start_due(self, pending: list[dict]) -> None:
        """Start the oldest job of each tenant that runs none, the tenants that ran least
        lately first, while there is room; without room, a due job asks one to yield."""
        now_s = time.monotonic()
        busy_tenants = set(self._running_tenants.values())
        for batch in sorted(pending, key=lambda batch: self._last_turn_s.get(batch.get(OWNER), -math.inf)):
            batch_id, tenant = batch["id"], batch.get(OWNER)
            if batch_id in self._running or tenant in busy_tenants:
                continue
            busy_tenants.add(tenant)  # a tenant's later job waits for its earlier one, even one not due
            if self._retry_at_s.get(batch_id, 0.0) > now_s:
                continue
            if len(self._running) >= MAX_RUNNING_JOBS:
                # A job that just gave its place back waits a slice before it asks for one:
                # the places go round, one a slice, instead of every job yielding in turn.
                if now_s - self._yielded_s.get(tenant, -math.inf) >= self.slice_s:
                    self._ask_to_yield(now_s)
                    return
                continue
            thread = threading.Thread(target=self._run_job, args=(batch_id,), name=f"job-{batch_id}", daemon=True)
            self._running[batch_id], self._running_tenants[batch_id] = thread, tenant
            self._started_s[batch_id] = self._last_turn_s[tenant] = now_s
            thread.start()

    def _ask_to_yield(self, now_s: float) -> None:
        """A tenant's job waits for room: the job that has run longest, once past its slice,
        stops between two arrivals (one at a time: the room it leaves goes to the waiting)."""
        if self._yielding:
            return
        batch_id = min(self._running, key=self._started_s.__getitem__)
        if now_s - self._started_s[batch_id] >= self.slice_s:
            log.info("cbatch jobs: %s gives its place to a waiting tenant's job after %.0f s; it goes on later",
                     batch_id, now_s - self._started_s[batch_id])
            self._yielding.add(batch_id)

    def _reap(self) -> None:
        for batch_id, thread in list(self._running.items()):
            if not thread.is_alive():
                if batch_id in self._yielding:
                    self._yielding.discard(batch_id)
                    self._yielded_s[self._running_tenants[batch_id]] = time.monotonic()
                del self._running[batch_id], self._running_tenants[batch_id], self._started_s[batch_id]

    def _run_job(self, batch_id: str) -> None:
        """A job's thread: its own client, one run of the job (to its end, or until it stops)."""
        client, health = self._connect()
        if client is None:  # the runner stops
            return
        retry_after_s = PAUSED_RETRY_S
        try:
            job = JobRun(self.store, batch_id, client, health,
                         lambda: self.is_stopping or batch_id in self._yielding)
            try:
                is_done = job.run()
            except OSError as err:
                is_done = self._on_os_error(job, batch_id, err)
                retry_after_s = DISK_FULL_RETRY_S
            except Exception as err:  # what no line's check foresaw fails this job, not the runner
                log.exception("cbatch jobs: %s failed", batch_id)
                is_done = job.fail("internal", f"the job runner failed on this job ({type(err).__name__}: {err}); "
                                               "its finished lines are kept")
            if not is_done:  # refused for too long, or cut short: later, with a fresh client
                self._retry_at_s[batch_id] = time.monotonic() + retry_after_s
        finally:
            client.close()

    @staticmethod
    def _on_os_error(job: JobRun, batch_id: str, err: OSError) -> bool:
        """A full disk pauses the job (its log holds only whole lines: it goes on from them
        once there is room, DISK_FULL_RETRY_S later at the soonest); any other error fails it."""
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            log.exception("cbatch jobs: %s failed", batch_id)
            return job.fail("internal", f"the job runner failed on this job ({type(err).__name__}: {err}); "
                                        "its finished lines are kept")
        log.error("cbatch jobs: %s waits: the state directory's disk is full (%s); it goes on from its finished "
                  "lines once there is room", batch_id, err.strerror)
        return False

    def _wait(self, is_done) -> None:
        while not is_done() and not self._is_parent_gone():
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
        """A client of the daemon once its model is loaded, and its health then; no client
        when the runner stops first."""
        client = None
        def is_ready() -> bool:
            nonlocal client
            try:
                client = client or Client(self.endpoint)
                return client.health()["status"] == "ok"
            except CbatchError:
                return False
        self._wait(is_ready)
        if self.is_stopping:
            if client is not None:
                client.close()
            return None, {}
        return client, client.health()

    def serve(self) -> None:
        lock_file = self._lock_state_dir()
        waiting_checked_s = 0.0
        retention_checked_s = -RETENTION_CHECK_S
        try:
            while not self._is_parent_gone():
                self._reap()
                if time.monotonic() - retention_checked_s >= RETENTION_CHECK_S:
                    retention_checked_s = time.monotonic()
                    let_go(self.store, self.retention_s)
                pending = self._pending()
                if time.monotonic() - waiting_checked_s >= WAITING_CHECK_S:
                    waiting_checked_s = time.monotonic()
                    self._end_waiting(pending)
                self._start_due([b for b in pending if b["id"] not in self._ended_ids])
                time.sleep(POLL_S)
        finally:
            for thread in list(self._running.values()):  # each stops between two arrivals
                thread.join()
            lock_file.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="cbatch-jobs")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--retention-s", type=float, default=0.0)
    parser.add_argument("--slice-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runner = JobRunner(args.endpoint, args.state_dir, args.retention_s, args.slice_s)

    def stop(signum, frame):
        runner.is_stopping = True  # each running job stops between two arrivals

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which drains us with SIGTERM
    runner.serve()


if __name__ == "__main__":
    main()
