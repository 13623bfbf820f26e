"""The lock beside an ipc:// endpoint's socket: held by the daemon serving it, from the
first moment of its start until it has removed its files.

A second daemon fails fast on it instead of silently taking the socket file over (ZeroMQ
replaces an existing ipc file on bind), and a client that finds no socket yet but the lock
held knows a daemon is starting there and waits for it (cbatch.client.base). So the
console script takes it before it imports the rest of the daemon, which takes seconds.
This module imports nothing heavy.
"""

import fcntl
import os

from cbatch.errors import ENDPOINT_IN_USE, INVALID_CONFIG, CbatchError


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def lock_endpoint(endpoint: str) -> int | None:
    """The held lock's descriptor (None for tcp://, whose bind fails by itself when the port is taken)."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    try:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        raise CbatchError(INVALID_CONFIG,
                          f"cannot use {endpoint}: {err.strerror} (does its directory exist?)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CbatchError(ENDPOINT_IN_USE,
                          f"another cbatch-worker is serving {endpoint}; stop it or pass --endpoint") from None
    return fd


def release_endpoint(endpoint: str, fd: int | None) -> None:
    if fd is not None:
        os.unlink(ipc_path(endpoint) + ".lock")
        os.close(fd)
