"""What daemons that died without cleaning up (SIGKILL, OOM, a power cut) left behind.

A daemon names its files after its pid: `cbatch-PID-control.sock`, `cbatch-PID-tick.sock`
and, with several HTTP processes, the directory `cbatch-PID-http-metrics` in the runtime
directory, and its ring `cbatch-PID` in /dev/shm (`cbatch-PID-ringN` once that was removed
and created again). Such a file whose pid is
no longer running belongs to nobody. A client endpoint's `PATH.lock` is held (flock) for
the daemon's life, so a lock that can be taken marks PATH and the lock as left over.
Files of a live daemon are never touched; only the current user's files are looked at.
"""

import fcntl
import os
import re
import shutil

from cbatch.ipc.ring import SHM_DIR

_TAGGED = re.compile(r"cbatch-(\d+)(-control\.sock|-tick\.sock|-http-metrics|-ring\d+)?")
_RING_SUFFIX = "-ring"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process holds the pid
    return True


def _owned(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.getuid()
    except OSError:
        return False


def _unlink(path: str, removed: list[str]) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        removed.append(path)
    except FileNotFoundError:
        pass


def remove_leftovers(runtime_dir: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove dead daemons' files from `runtime_dir` and `shm_dir`; returns their paths."""
    removed: list[str] = []
    for directory in (runtime_dir, shm_dir):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            match = _TAGGED.fullmatch(name)
            suffix = match.group(2) or "" if match else ""
            is_socket = directory == runtime_dir and match and suffix and not suffix.startswith(_RING_SUFFIX)
            is_ring = directory == shm_dir and match and (not suffix or suffix.startswith(_RING_SUFFIX))
            if (is_socket or is_ring) and _owned(path) and not _pid_running(int(match.group(1))):
                _unlink(path, removed)
            elif directory == runtime_dir and name.endswith(".sock.lock") and _owned(path):
                _remove_if_unlocked(path, removed)
    return removed


def _remove_if_unlocked(lock_path: str, removed: list[str]) -> None:
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return  # a live daemon serves this endpoint
    try:  # unlinked while locked, so a daemon starting now gets a fresh lock file
        _unlink(lock_path[: -len(".lock")], removed)
        _unlink(lock_path, removed)
    finally:
        os.close(fd)
