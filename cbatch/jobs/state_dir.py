"""The daemon's state directory (`cbatch-worker --state-dir`): uploaded files and batch jobs,
kept across restarts of the daemon, kill -9 included.

Every file is written whole under a temporary name, fsynced and renamed into place (and
the directory fsynced), so a reader, or a daemon started after a crash, sees the old file
or the new one, never a part. The one file that grows in place, a job's results log, is
appended a line at a time and fsynced by group commit (cbatch.jobs.results).
"""

import fcntl
import hashlib
import json
import os
import re
import tempfile
import time

from cbatch.errors import INVALID_CONFIG, CbatchError

STATE_DIR_MODE = 0o700  # a job's prompts and answers are its owner's
RUNNER_LOCK = "runner.lock"  # held by the job runner of the daemon whose directory it is
MODEL_FILE = "model.json"  # the model the directory's jobs were made for
# A daemon that just stopped (kill -9 included) may leave its runner holding the lock for
# a moment: a new daemon waits this long before it takes the directory for another's.
LOCK_WAIT_S = 10.0
LOCK_POLL_S = 0.1


def endpoint_dir_name(endpoint: str) -> str:
    """The endpoint as a directory name: readable, and unique however long the endpoint."""
    readable = re.sub(r"[^A-Za-z0-9.-]+", "_", endpoint).strip("_")[:64]
    return f"{readable}-{hashlib.sha256(endpoint.encode()).hexdigest()[:8]}"


def model_dir_name(model_path: str) -> str:
    """The model file as a directory name: its name, and a hash of its name and size."""
    name, size = os.path.basename(model_path), os.path.getsize(model_path)
    readable = re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_")[:64]
    return f"{readable}-{hashlib.sha256(f'{name}:{size}'.encode()).hexdigest()[:8]}"


def default_state_dir(endpoint: str, model_path: str) -> str:
    """$XDG_STATE_HOME/cbatch/<endpoint>/<model>, or the same under ~/.local/state: one per
    endpoint and model, so that two daemons on one host never share one, and a daemon
    started on the same endpoint with another model has its own jobs, not a refusal."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "cbatch", endpoint_dir_name(endpoint), model_dir_name(model_path))


def _is_free(path: str) -> bool:
    """Whether no job runner holds the directory's lock (taken and let go at once)."""
    with open(os.path.join(path, RUNNER_LOCK), "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock_file, fcntl.LOCK_UN)
        return True


def claim_state_dir(path: str, model_path: str) -> None:
    """A state directory belongs to one daemon and one model: refuse one whose jobs another
    running daemon runs, or whose jobs were made for another model file (their lines name
    that model); mark a new one with this daemon's model."""
    deadline_s = time.monotonic() + LOCK_WAIT_S
    while not _is_free(path):
        if time.monotonic() > deadline_s:
            raise CbatchError(INVALID_CONFIG, f"the state directory {path} is in use by another running daemon: "
                                              "give this one its own --state-dir")
        time.sleep(LOCK_POLL_S)
    model = {"model": os.path.basename(model_path), "bytes": os.path.getsize(model_path)}
    marked = read_json(os.path.join(path, MODEL_FILE))
    if marked is None:
        write_json(os.path.join(path, MODEL_FILE), model)
    elif marked != model:
        raise CbatchError(INVALID_CONFIG, f"the state directory {path} holds the files and jobs of model "
                                          f"{marked.get('model')!r}, not {model['model']!r}: give this daemon its "
                                          "own --state-dir")


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
