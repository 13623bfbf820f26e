"""A process the supervisor keeps running beside the front-end (an HTTP server, the batch
job runner): restarted if it dies, after a back-off that grows while it keeps dying at
once (up to MAX_RESTART_BACKOFF_S), given up after `max_quick_deaths` of them in a row
(never, for a process whose work would otherwise stop unseen); drained with SIGTERM,
killed if it lingers."""

import logging
import signal
import subprocess
import sys
import time

from cbatch.workers.daemon.stop_signals import children_ignore_sigint_sighup

RESTART_BACKOFF_S = 0.5  # before the first restart; doubled after each further quick death
QUICK_DEATH_S = 30.0  # a process that dies sooner than this after its start did not get going
MAX_QUICK_DEATHS = 5  # in a row, then the daemon stops restarting it (unless max_quick_deaths is None)
MAX_RESTART_BACKOFF_S = 60.0  # the back-off grows no longer than this
STOP_TIMEOUT_S = 10.0  # after the daemon drained, the process's last work gets this long


def module_argv(module: str, *args: str) -> list[str]:
    """`python -m module args` without the current directory on the module path (`-P`,
    Python 3.11 and later): started where a folder named `cbatch` lies (a source checkout
    beside a regular install), `-m` would import that folder instead of the installed
    package the daemon runs."""
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", module, *args]


class ChildProcess:
    """`argv()` and `pass_fds` say how to start it; `title` names it in `log`'s lines."""

    title = "process"
    pass_fds: tuple[int, ...] = ()
    max_quick_deaths: int | None = MAX_QUICK_DEATHS  # None: restarted however often it dies

    def __init__(self, log: logging.Logger, env: dict | None):
        self.log = log
        self.env = env  # None: the daemon's own
        self.process: subprocess.Popen | None = None
        self._started_s = 0.0
        self._died_s: float | None = None
        self.num_quick_deaths = 0
        self.num_restarts = 0
        self.is_given_up = False  # it kept dying at once, and is not restarted again

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        self._started_s, self._died_s = time.monotonic(), None
        with children_ignore_sigint_sighup():  # a Ctrl-C to the process group is the daemon's to handle
            self.process = subprocess.Popen(self.argv(), pass_fds=self.pass_fds, env=self.env)

    def poll(self) -> None:
        """Restart a process that died (not while the daemon drains: see drain()), after a
        back-off that grows while it keeps dying at once; give up after MAX_QUICK_DEATHS."""
        if self.process is None or self.process.poll() is None:
            return
        now = time.monotonic()
        if self._died_s is None:
            self._died_s = now
            is_quick = now - self._started_s < QUICK_DEATH_S
            self.num_quick_deaths = self.num_quick_deaths + 1 if is_quick else 0
            if self.max_quick_deaths is not None and self.num_quick_deaths >= self.max_quick_deaths:
                self.log.error("%s exited (code %s), %d times in a row within %.0f s of its start; it is not "
                               "restarted again", self.title, self.process.returncode, self.num_quick_deaths,
                               QUICK_DEATH_S)
                self.process, self.is_given_up = None, True
                return
            self.log.warning("%s exited (code %s, %d times in a row within %.0f s of its start); restarting",
                             self.title, self.process.returncode, self.num_quick_deaths, QUICK_DEATH_S)
        backoff_s = min(RESTART_BACKOFF_S * 2 ** max(self.num_quick_deaths - 1, 0), MAX_RESTART_BACKOFF_S)
        if now - self._died_s >= backoff_s:
            self.num_restarts += 1
            self.start()

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def state(self) -> dict:
        """For the daemon's STATS: whether it runs now, and how often it died at once in a row."""
        return {"is_running": self.is_running, "num_quick_deaths": self.num_quick_deaths,
                "num_restarts": self.num_restarts, "is_given_up": self.is_given_up}

    def send(self, signum: int) -> None:
        """To the process while it runs (SIGTERM drains it; SIGHUP has a server read its keys again)."""
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
