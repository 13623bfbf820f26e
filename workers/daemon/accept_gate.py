"""Lets libzmq accept one connection at a time on the client socket's listener.

libzmq accepts on its own I/O thread whenever the listening socket is readable, and its
ipc:// listener aborts the whole process when an accept finds no descriptor left (EMFILE
is missing from the errors its accept tolerates, in 4.3.5 and its current source alike).
Refusing connections after the fact cannot keep up with a burst: the I/O thread accepts
hundreds in a millisecond. So the listener's registration in libzmq's epoll set is made
one-shot: it reports one readable event, libzmq accepts one connection (or fails to, which
its monitor reports too), and the kernel reports nothing more until the front-end re-arms
it, which it does only while a descriptor is free for another connection. Connects beyond
that wait in the kernel's listen queue (and past its length are retried by the client).

Linux only: the registration (libzmq's pointer to its poll entry) is read from the epoll
descriptor's /proc fdinfo, and re-armed with epoll_ctl(EPOLL_CTL_MOD) as it was, plus
EPOLLONESHOT. Where it cannot be found, find_accept_gate() returns None and the front-end
refuses connections after the fact only.
"""

import ctypes
import os
import re
import socket
import stat
import time

EPOLL_CTL_MOD = 3
EPOLLONESHOT = 1 << 30
SETUP_TIMEOUT_S = 2.0  # libzmq registers a new listener on its I/O thread, soon after bind
SETUP_POLL_S = 0.01
_REGISTRATION = re.compile(r"tfd:\s*(\d+)\s+events:\s*([0-9a-f]+)\s+data:\s*([0-9a-f]+)"
                           r"\s+pos:\s*\d+\s+ino:\s*([0-9a-f]+)")


class _EpollEvent(ctypes.Structure):
    # glibc packs struct epoll_event on x86-64 only (12 bytes); elsewhere data is 8-aligned.
    # The kernel's own answer (a test may make platform.machine() report another CPU).
    _pack_ = 1 if os.uname().machine == "x86_64" else 8
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


class AcceptGate:
    def __init__(self, epoll_fd: int, listener_fd: int, events: int, data: int):
        self._epoll_fd, self._listener_fd = epoll_fd, listener_fd
        self._event = _EpollEvent(events | EPOLLONESHOT, data)
        self._libc = ctypes.CDLL(None, use_errno=True)

    def arm(self) -> bool:
        """Let libzmq accept one more connection; False if the registration is gone."""
        return self._libc.epoll_ctl(self._epoll_fd, EPOLL_CTL_MOD, self._listener_fd, ctypes.byref(self._event)) == 0


def find_accept_gate(is_our_listener) -> AcceptGate | None:
    """The gate of the one listening socket for which is_our_listener(sock) holds, once
    libzmq has registered it; the registration is left as it is until the first arm()."""
    deadline_s = time.monotonic() + SETUP_TIMEOUT_S
    listener = _find_listener(is_our_listener)
    while listener is not None:
        registration = _find_registration(*listener)
        if registration is not None:
            return AcceptGate(registration[0], listener[0], *registration[1:])
        if time.monotonic() > deadline_s:
            return None
        time.sleep(SETUP_POLL_S)
    return None


def _find_listener(is_our_listener) -> tuple[int, int] | None:
    """(descriptor, inode) of our listening socket."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and is_our_listener(sock):
                    return fd, os.fstat(fd).st_ino
        except OSError:
            continue  # closed meanwhile, or not ours to look at
    return None


def _find_registration(listener_fd: int, inode: int) -> tuple[int, int, int] | None:
    """(epoll descriptor, events, data) of the epoll set that watches the listener."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            with open(f"/proc/self/fdinfo/{name}") as info:
                text = info.read()
        except OSError:
            continue
        for match in _REGISTRATION.finditer(text):
            if int(match.group(1)) == listener_fd and int(match.group(4), 16) == inode:
                return int(name), int(match.group(2), 16) & ~EPOLLONESHOT, int(match.group(3), 16)
    return None
