"""Which connections the front-end keeps when descriptors run short.

Every client connection is a descriptor of the daemon. Invariant: free descriptors stay
above half the reserve (MIN_FREE_DESCRIPTORS, or 1/FREE_DESCRIPTORS_FRACTION of the limit),
what the daemon opens for itself (a restarted worker's sockets and pipes, the ring, the
tick socket: under 20). The accept gate (accept_gate.py) lets libzmq accept one connection
at a time, and only while that holds after one more. A connection accepted into the
reserve is refused: the message it sends (a HELLO) is answered with an `unavailable` error
that says why, and it is shut down once the client closes it or REFUSED_LINGER_S passed.
"""

import logging
import os
import resource
import socket

from cbatch.workers.daemon.accept_gate import find_accept_gate

log = logging.getLogger("cbatch.daemon")

MIN_FREE_DESCRIPTORS = 32
FREE_DESCRIPTORS_FRACTION = 16  # of the limit: a bigger daemon meets bigger bursts
REFUSED_LINGER_S = 2.0  # a refused connection its client does not close is shut down after this
ROOM_RECHECK_S = 1.0  # with no accept or close, whether the gate may open is looked at this often


class ConnectionGuard:
    def __init__(self, endpoint_address, num_other_fds: int):
        self._endpoint_address = endpoint_address
        self._connection_fds: set[int] = set()  # accepted, not yet disconnected
        self._other_fds = num_other_fds  # as last counted
        self._refused_at: dict[int, float] = {}  # descriptor -> monotonic time it was refused
        self._gate = find_accept_gate(self._is_ours)
        if self._gate is None:
            log.warning("cannot pace libzmq's accepts on %s: a burst of connects can exhaust the daemon's "
                        "descriptors", endpoint_address)
        self._is_armed = False  # the gate lets one accept through, not yet reported
        # Room is counted again after an accept or a close, else every ROOM_RECHECK_S: near
        # a big limit a count costs a pass over every descriptor.
        self._recheck_s = 0.0

    def _is_ours(self, conn: socket.socket) -> bool:
        return shared_address(conn.getsockname()) == self._endpoint_address

    def on_accepted(self, fd: int, is_open: bool, now_s: float) -> None:
        """is_open: not closed again among the monitor events read with this one."""
        self._is_armed, self._recheck_s = False, 0.0
        self._connection_fds.add(fd)
        if is_open and self._num_free() < self._keep_free():
            self._refused_at[fd] = now_s

    def on_accept_failed(self) -> None:
        self._is_armed, self._recheck_s = False, 0.0

    def on_closed(self, fd: int) -> None:
        self._recheck_s = 0.0
        self._connection_fds.discard(fd)
        self._refused_at.pop(fd, None)

    def is_refused(self, fd: int) -> bool:
        return fd in self._refused_at

    def refusal(self) -> str:
        return (f"the daemon has no room for another client: {len(self._connection_fds)} connections under its "
                f"open-file limit of {_limit()}; try again later, or raise its limit (ulimit -Hn, LimitNOFILE=)")

    def pace(self, now_s: float) -> None:
        """Shut refused connections down that outstayed REFUSED_LINGER_S, and let libzmq
        accept the next connection when there is room for it."""
        for fd, refused_s in list(self._refused_at.items()):
            if now_s - refused_s > REFUSED_LINGER_S:
                del self._refused_at[fd]
                self._shut_down(fd)
        if self._gate is None or self._is_armed or now_s < self._recheck_s:
            return
        self._recheck_s = now_s + ROOM_RECHECK_S
        if self._num_free() - 1 > self._keep_free() // 2:
            if not self._gate.arm():
                log.warning("libzmq dropped its listener's registration: accepts are no longer paced")
                self._gate = None
            self._is_armed = True

    def _keep_free(self) -> int:
        return max(MIN_FREE_DESCRIPTORS, _limit() // FREE_DESCRIPTORS_FRACTION)

    def _num_free(self) -> int:
        """Counting open descriptors costs a pass over them all (60 ms at 20000), so they
        are counted only near the limit; elsewhere the count is the connections' plus the
        rest's as last counted."""
        limit = _limit()
        if self._other_fds + len(self._connection_fds) < limit - 2 * self._keep_free():
            return limit - self._other_fds - len(self._connection_fds)
        num_open = len(os.listdir("/proc/self/fd")) - 1  # less listdir's own
        self._other_fds = num_open - len(self._connection_fds)
        return limit - num_open

    def _shut_down(self, fd: int) -> None:
        """Shut the connection down under libzmq, which then reads its end, closes it and
        frees the descriptor. Only a connection to our own endpoint is touched."""
        try:
            with socket.socket(fileno=os.dup(fd)) as conn:
                if self._is_ours(conn):
                    conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed meanwhile, or not a socket any more


def _limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (1 << 62) if soft == resource.RLIM_INFINITY else soft


def shared_address(address) -> str | int:
    """What an accepted connection's local address shares with the endpoint: the socket
    path over ipc, the port over tcp."""
    if isinstance(address, tuple):
        return address[1]
    if isinstance(address, bytes):  # an abstract socket name
        address = "@" + address[1:].decode(errors="replace")
    if address.startswith("ipc://"):
        return address[len("ipc://"):]
    if address.startswith("tcp://"):
        return int(address.rsplit(":", 1)[1])
    return address
