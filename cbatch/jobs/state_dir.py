"""The daemon's state directory (`cbatch-worker --state-dir`): uploaded files and batch jobs,
kept across restarts of the daemon, kill -9 included.

Every file is written whole under a temporary name, fsynced and renamed into place (and
the directory fsynced), so a reader, or a daemon started after a crash, sees the old file
or the new one, never a part. The one file that grows in place, a job's results log, is
appended a line at a time and fsynced by group commit (cbatch.jobs.results).
"""

import json
import os
import tempfile

from cbatch.errors import CbatchError, INVALID_CONFIG

STATE_DIR_MODE = 0o700  # a job's prompts and answers are its owner's


def default_state_dir() -> str:
    """$XDG_STATE_HOME/cbatch, or ~/.local/state/cbatch."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "cbatch")


def check_state_dir(path: str) -> str:
    """The directory's absolute path once it exists and takes a file; else a CbatchError
    that names the flag to change."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, mode=STATE_DIR_MODE, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise CbatchError(INVALID_CONFIG, f"cannot write the state directory {path}: {err.strerror}; "
                                          "pass another --state-dir") from None
    return path


def fsync_dir(path: str) -> None:
    """A rename or a new file in `path` survives a crash only once the directory is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_from(write, path: str) -> None:
    """Atomically make `path` what write(binary file) writes."""
    directory = os.path.dirname(path)
    fd, temporary_path = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary_path, path)
    except BaseException:
        remove_if_present(temporary_path)
        raise
    fsync_dir(directory)


def write_json(path: str, obj: dict) -> None:
    replace_from(lambda out: out.write(json.dumps(obj, separators=(",", ":")).encode()), path)


def read_json(path: str) -> dict | None:
    """The object at `path`, or None when there is none (deleted meanwhile)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def remove_if_present(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
