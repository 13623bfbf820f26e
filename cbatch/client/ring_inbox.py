"""What the process's shared ring reader (shared_ring.py) hands one session: its inbox."""

import os
import threading

from cbatch.ipc.ring import RingError


class RingInbox:
    """What the shared reader hands one session: record rows per request, the ids whose
    records may be missing, and a ring error. Filled by any thread; drained by the
    session's own, which `wake_fd` (a pipe) wakes once per fill until it drains. Rows of a
    muted request wake nobody: its reader waits for its FINISHED message, which drains
    them, and the session's safety poll drains them meanwhile."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rows: dict[int, list] = {}  # request id -> [(index, token_id, flags, finish, count, text)]
        self._gapped_ids: set[int] = set()
        self._error: RingError | None = None
        self._is_woken = False
        self._muted_ids: set[int] = set()
        self.wake_fd, self._wake_write_fd = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_write_fd, False)

    def set_muted(self, request_id: int, is_muted: bool) -> None:
        with self._lock:
            if is_muted:
                self._muted_ids.add(request_id)
            else:
                self._muted_ids.discard(request_id)

    def put(self, rows_by_request: dict[int, list], gapped_ids=(), error: RingError | None = None) -> None:
        with self._lock:
            muted_ids = self._muted_ids
            is_wake_due = bool(gapped_ids) or error is not None
            for request_id, rows in rows_by_request.items():
                self._rows.setdefault(request_id, []).extend(rows)
                is_wake_due = is_wake_due or request_id not in muted_ids
            self._gapped_ids.update(gapped_ids)
            self._error = self._error or error
            if self._is_woken or not is_wake_due:
                return
            self._is_woken = True
            # Written and read under the lock, so that the pipe holds a byte exactly while
            # _is_woken is set: a byte left behind by a drain that ran between the flag and
            # the write would keep the pipe readable for good, and a driver that keeps it
            # registered with its event loop would spin.
            try:
                os.write(self._wake_write_fd, b"\0")
            except (BlockingIOError, OSError):
                pass  # a closed pipe has no reader left

    def drain(self) -> tuple[dict[int, list], set[int], RingError | None]:
        """Everything put since the last drain; clears the wake-up."""
        with self._lock:
            if not self._is_woken and not self._rows:
                return {}, set(), None  # the common case of a driver's safety poll
            taken = self._rows, self._gapped_ids, self._error
            self._rows, self._gapped_ids, self._error = {}, set(), None
            if self._is_woken:  # muted rows alone leave the pipe empty
                self._is_woken = False
                try:
                    os.read(self.wake_fd, 4096)
                except (BlockingIOError, OSError):
                    pass
        return taken

    def close(self) -> None:
        os.close(self.wake_fd)
        os.close(self._wake_write_fd)
