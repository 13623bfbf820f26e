"""The front-end's socket to clients: binding, CurveZMQ, and clients that go away or stall.

It knows connections, not requests. It tells its owner three things: a message arrived
(from a live connection), a client went away (closed, crashed, killed; and whether it may
come back), and a client stopped reading (it took nothing for MAX_STALL_S while messages
waited for it, or did not come back within the grace its owner gave it). A send never
blocks the loop: what does not fit in a client's queue, or waits for a client to
reconnect, waits in its backlog.
"""

import errno
import os
import socket
import struct
import time

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from cbatch.config import DaemonConfig
from cbatch.errors import INVALID_CONFIG, UNAVAILABLE, CbatchError
from cbatch.protocol import MAX_FRAME_BYTES, MsgType, pack
from cbatch.workers.daemon.backlog import MAX_STALL_S, Backlog, RequestPauses
from cbatch.workers.daemon.connection_guard import ConnectionGuard, shared_address

CLOSE_LINGER_MS = 500  # the last replies still reach clients when the daemon stops
PEER_HEARTBEAT_MS = 1000
CLOSED_MEMORY_S = 10.0  # how long messages still queued from a closed connection are recognised
MAX_MESSAGES_PER_TURN = 256  # then the worker's events get their turn


def router_socket(zctx: zmq.Context, config: DaemonConfig) -> zmq.Socket:
    """The clients' ROUTER socket, its options set, not yet bound."""
    socket = zctx.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client raises instead of queueing
    socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client reconnecting under its id takes it over
    # Over tcp a peer can vanish without closing: libzmq's own PING/PONG notices it. Not
    # over ipc, where the kernel closes a dead peer's socket at once, and where a PING
    # waits unread behind the messages of a live client that is slow to read (a busy HTTP
    # server): its timeout would cut that client off, and cancel its requests, before the
    # stall rule (MAX_STALL_S without taking anything) does.
    if config.endpoint.startswith("tcp://"):
        socket.setsockopt(zmq.HEARTBEAT_IVL, PEER_HEARTBEAT_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * PEER_HEARTBEAT_MS)
    # A frame bigger than any valid message drops the connection before it is buffered.
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
    # No receive high-water mark. At the mark libzmq stops reading that connection, and
    # if the peer dies while it is stopped, resuming the read aborts the whole process
    # (libzmq 4.3's "!_io_error" assertion): a client that floods submits and is then
    # killed took the daemon down. The front-end reads faster than a client can write
    # (each message costs it one validation), so the kernel's socket buffer bounds
    # what waits.
    socket.setsockopt(zmq.RCVHWM, 0)
    return socket


class ClientLink:
    def __init__(self, zctx: zmq.Context, config: DaemonConfig):
        self.socket = router_socket(zctx, config)
        self._authenticator = None
        self.disconnects = None
        try:
            if config.curve_secret_key:
                self._authenticator = self._require_curve(zctx, config)
            self.socket.bind(config.endpoint)
        except Exception:
            self.close()
            raise
        # Dead clients: a disconnect event names the connection's file descriptor, and every
        # message says which descriptor it came on. An accept event names the new
        # connection's descriptor too (one that leaves too few free is refused), and an
        # accept, done or failed, lets the guard's gate through the next one.
        self.disconnects = self.socket.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_ACCEPT_FAILED)
        self._guard = ConnectionGuard(shared_address(self.socket.last_endpoint.decode()),
                                      len(os.listdir("/proc/self/fd")))
        self._guard.pace(time.monotonic())
        self._peer_by_fd: dict[int, bytes] = {}
        # identity -> (descriptor, monotonic time, client pid) of connections that closed: what
        # they sent before closing may still be queued, and must not start work nobody reads.
        # A message on that descriptor number from the same process is the client reconnected.
        self._closed: dict[bytes, tuple[int, float, int | None]] = {}
        self._peer_pid_by_fd: dict[int, int] = {}  # ipc connections: the client process's pid
        # Clients whose connection died that may come back: identity -> (accepts counted
        # when it went, monotonic time). A message on a connection accepted since is its return.
        self._away: dict[bytes, tuple[int, float]] = {}
        self._num_accepts = 0
        self._accept_number: dict[int, int] = {}  # descriptor -> _num_accepts when it was accepted
        self.reconnect_grace_s = config.reconnect_grace_s
        self._stalled: set[bytes] = set()  # cut off: its requests were cancelled
        self.newly_stalled: set[bytes] = set()  # stalled since the owner last looked
        self._backlogs: dict[bytes, Backlog] = {}  # clients whose queue is full -> what waits for them
        self.lost_finish_ids: list[int] = []  # FINISHED messages a cut-off client's backlog held
        self.pauses = RequestPauses()  # requests paused for what waits for their client

    def _require_curve(self, zctx: zmq.Context, config: DaemonConfig) -> ThreadAuthenticator:
        """Encrypt and authenticate with CurveZMQ: the daemon's keys from its certificate
        file; clients admitted by public key (a directory of certificates) or, without
        one, any client that knows the daemon's public key."""
        public_key, secret_key = zmq.auth.load_certificate(config.curve_secret_key)
        if not secret_key:
            raise CbatchError(INVALID_CONFIG, f"{config.curve_secret_key} holds no secret key")
        authenticator = ThreadAuthenticator(zctx)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=config.curve_clients_dir or zmq.auth.CURVE_ALLOW_ANY)
        self.socket.curve_server = True
        self.socket.curve_publickey, self.socket.curve_secretkey = public_key, secret_key
        return authenticator

    def receive(self, on_disconnect, on_unstall):
        """Yield (identity, frames) of waiting messages, at most MAX_MESSAGES_PER_TURN.
        Disconnects are taken first each time, since a closed descriptor may be reused by
        the next message; a message a connection sent just before it closed is dropped."""
        for _ in range(MAX_MESSAGES_PER_TURN):
            self.take_disconnects(on_disconnect)
            if not self.socket.poll(0):
                return
            identity_frame, *message = self.socket.recv_multipart(copy=False)
            identity = identity_frame.bytes
            if message:
                fd = int(message[0].get("__fd"))
                if self._guard.is_refused(fd):  # never welcomed: told why, and closed soon
                    self._tell_refused(identity)
                    continue
                closed = self._closed.get(identity)
                if closed is not None:
                    if closed[0] == fd and (closed[2] is None or _peer_pid(fd) != closed[2]):
                        continue
                    del self._closed[identity]  # the same client, reconnected
                if self._peer_by_fd.get(fd) != identity:
                    self._peer_by_fd[fd] = identity
                    self._note_peer_pid(fd)
                away = self._away.get(identity)
                if away is not None and self._accept_number.get(fd, 0) > away[0]:
                    del self._away[identity]  # back on a new connection: its backlog goes out
            if identity in self._stalled:
                self._stalled.discard(identity)
                on_unstall(identity)
            yield identity, [frame.bytes for frame in message]

    def take_disconnects(self, on_disconnect) -> None:
        """Take the monitor's events: disconnects, and accepts to refuse. All that wait are
        read first: an accepted descriptor that closed since must not be shut down, as
        its number may already be another connection's."""
        events = []
        while self.disconnects.poll(0):
            event = recv_monitor_message(self.disconnects)
            events.append((event["event"], int(event["value"])))
        last_disconnect = {fd: at for at, (event, fd) in enumerate(events) if event == zmq.EVENT_DISCONNECTED}
        now_s = time.monotonic()
        for at, (event, fd) in enumerate(events):
            if event == zmq.EVENT_ACCEPTED:
                self._num_accepts += 1
                self._accept_number[fd] = self._num_accepts
                self._guard.on_accepted(fd, last_disconnect.get(fd, -1) < at, now_s)
                continue
            if event == zmq.EVENT_ACCEPT_FAILED:
                self._guard.on_accept_failed()
                continue
            self._guard.on_closed(fd)
            self._accept_number.pop(fd, None)
            identity = self._peer_by_fd.pop(fd, None)
            pid = self._peer_pid_by_fd.pop(fd, None)
            if identity is not None:
                is_gone = pid is not None and not _is_process_stopped(pid)
                if is_gone:  # what it sent before it closed or died must not start work
                    self._closed = {i: c for i, c in self._closed.items() if now_s - c[1] < CLOSED_MEMORY_S}
                    self._closed[identity] = (fd, now_s, pid)
                self._stalled.discard(identity)
                on_disconnect(identity, not is_gone)
        self._guard.pace(now_s)

    def wait_for_return(self, identity: bytes, now_s: float) -> None:
        """Its connection died but the client may come back (a paused process, a broken
        tcp connection): keep what is sent to it until it does, for reconnect_grace_s."""
        self._away[identity] = (self._num_accepts, now_s)
        self._backlogs.setdefault(identity, Backlog(now_s)).progress_s = now_s

    def forget(self, identity: bytes) -> None:
        """It is gone for good: nothing waits for it any more."""
        self._backlogs.pop(identity, None)
        self._away.pop(identity, None)
        self.pauses.forget(identity)

    def _note_peer_pid(self, fd: int) -> None:
        """Over ipc the kernel names the client process. Its connection dies while the
        process lives only when it is stopped (SIGSTOP, a debugger: libzmq's I/O thread
        answers heartbeats through any pause of Python), so a client that closed or was
        killed is told from one that will come back."""
        pid = _peer_pid(fd)
        if pid is not None:
            self._peer_pid_by_fd[fd] = pid

    def send(self, identity: bytes, msg_type: MsgType, body: dict) -> bool:
        """Send without blocking, or keep the message in the client's backlog when its
        queue is full; False if it was dropped (the client is gone, or cut off)."""
        backlog = self._backlogs.get(identity)
        if backlog is not None:
            backlog.add(msg_type, body)
            self.pauses.after_add(identity, backlog, msg_type, body)
            return True
        try:
            self._send_now(identity, msg_type, body)
            return True
        except zmq.ZMQError as err:
            # Again: its queue is full. EHOSTUNREACH: its connection died, and whether it
            # may come back is known when the disconnect event is read.
            if (identity in self._stalled or identity in self._closed
                    or err.errno not in (zmq.EAGAIN, errno.EHOSTUNREACH)):
                return False  # cut off, or gone: what it lacks is re-sent or fetched when it speaks again
            self._backlogs[identity] = backlog = Backlog(time.monotonic())
            backlog.add(msg_type, body)
            self.pauses.after_add(identity, backlog, msg_type, body)
            return True

    def _tell_refused(self, identity: bytes) -> None:
        try:
            self._send_now(identity, MsgType.ERROR, {"code": UNAVAILABLE, "message": self._guard.refusal()})
        except zmq.ZMQError:
            pass  # gone already, or not reading: the refusal's linger shuts it down

    def _send_now(self, identity: bytes, msg_type: MsgType, body: dict) -> None:
        self.socket.send_multipart([identity, *pack(msg_type, body)], zmq.NOBLOCK)

    def flush(self, now_s: float) -> None:
        """Send what waits in backlogs as far as the clients' queues take it; cut off a
        client that took nothing for MAX_STALL_S, or did not come back within
        reconnect_grace_s (its backlog is dropped: its FINISHED messages go to
        lost_finish_ids, its records stay fetchable). Also paces accepts (ConnectionGuard)."""
        self._guard.pace(now_s)
        for identity, backlog in list(self._backlogs.items()):
            self._flush_one(identity, backlog, now_s)
            self.pauses.after_flush(identity, self._backlogs.get(identity))

    def _flush_one(self, identity: bytes, backlog: Backlog, now_s: float) -> None:
        limit_s = self.reconnect_grace_s if identity in self._away else MAX_STALL_S
        try:
            while backlog.messages:
                msg_type, body, _ = backlog.messages[0]
                self.socket.send_multipart([identity, *pack(msg_type, body)], zmq.NOBLOCK)
                backlog.sent_first(now_s)
                self._away.pop(identity, None)  # it took a message: it is back
            if identity not in self._away:
                del self._backlogs[identity]
                return
        except zmq.ZMQError as err:
            if err.errno not in (zmq.EAGAIN, errno.EHOSTUNREACH):
                del self._backlogs[identity]  # gone: its disconnect event follows
                return
        if now_s - backlog.progress_s < limit_s:
            return
        self.lost_finish_ids += backlog.finished_ids()
        self._stalled.add(identity)
        self.newly_stalled.add(identity)
        self._away.pop(identity, None)
        del self._backlogs[identity]

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
        if self.disconnects is not None:
            self.socket.disable_monitor()
            self.disconnects.close()
        self.socket.close()


def _peer_pid(fd: int) -> int | None:
    """The process at the other end of an ipc connection; None over tcp, or once closed."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            if conn.family == socket.AF_UNIX:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                return struct.unpack("3i", creds)[0]
    except OSError:
        pass
    return None


def _is_process_stopped(pid: int) -> bool:
    """Stopped by a signal or a tracer: it may go on; exited (a zombie too) or running: no."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
