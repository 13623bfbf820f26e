"""SIGTERM and SIGINT in the daemon's main process, from its first moment to its last.

A terminal's Ctrl-C goes to the whole process group: the daemon and every process it
started. Only the daemon acts on it (it drains, then stops the others), so a child must
never see it, not even while it imports itself, before its own code could ignore it:
children are started with SIGINT ignored and blocked, which they inherit across exec
(Python keeps an ignored SIGINT ignored). The daemon's own handlers are set before it
creates anything it must remove (the ring, its sockets), so a stop that comes while it
starts is a stop like any other, and never an exception that skips the clean-up.

SIGHUP asks the daemon to read its API keys file again (keys_reload.py), and the daemon
passes it on to its HTTP servers. A child is started with SIGHUP ignored and blocked too:
one sent while the child starts waits, pending, until the HTTP server has set its handler
and unblocks it, instead of ending it (the default action) before it could.
"""

import contextlib
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


CHILD_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def children_ignore_sigint_sighup():
    """Around starting a child process. A SIGINT or SIGHUP that comes meanwhile waits,
    blocked (Linux keeps a blocked signal pending even while it is ignored), and reaches
    this process's handler when the block ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(CHILD_IGNORED_SIGNALS))
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in CHILD_IGNORED_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(CHILD_IGNORED_SIGNALS))


class StopSignals:
    """Set on creation: every stop signal from then on is recorded, and handed to whoever
    serves (`notify`, an object with a `stop_requested` flag) once there is one."""

    def __init__(self):
        self.is_received = False
        self._notified = None
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        # A reload (keys_reload.py) asked for while the daemon starts is no stop: ignored
        # until the keys are there to read again.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _on_signal(self, signum, frame) -> None:
        self.is_received = True
        if self._notified is not None:
            self._notified.stop_requested = True

    def notify(self, served) -> None:
        self._notified = served
        served.stop_requested = served.stop_requested or self.is_received

    @staticmethod
    def ignore() -> None:
        """Everything is cleaned up: a repeated stop signal must not turn the exit code into
        "killed by SIGTERM" while the interpreter shuts down (it restores the default
        handler of a signal that has a Python one, but not of an ignored signal)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
