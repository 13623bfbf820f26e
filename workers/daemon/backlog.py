"""Messages waiting for a client that reads slower than the daemon sends.

A client's ZeroMQ queue fills when it stops reading for a moment, or when one caller of
a client that serves many (the HTTP server) asks for a burst of replies. Cancelling all
of such a client's requests would punish every caller for one; dropping messages would
lose tokens. So what does not fit waits here, and a request's consecutive RECORDS merge
into one message (as vLLM's output collector merges a lagging consumer's outputs): the
backlog holds about one RECORDS message per request between its other messages, and
grows with the requests, not with the steps. A merged message stays within
MAX_MERGED_RECORDS and MAX_MERGED_BYTES, far inside what a client unpacks (a bigger one
would fail its whole connection); past them the records go on in another message. It
drains as the client reads. Only a client that takes nothing for MAX_STALL_S is cut off
(the front-end then cancels its requests).

A client that keeps reading, only slower than the model writes, would let one request's
records pile up here without end: past MAX_BUFFERED_BYTES_PER_REQUEST of records waiting
for it, the request is paused (ClientLink tells the front-end, which tells the worker: the
request keeps its slot and its KV but leaves the steps), and it goes on once what waits
falls under RESUME_BYTES_PER_REQUEST. Back-pressure on that request alone.
"""

from collections import deque

import msgpack

from cbatch.protocol import MAX_CONTAINER_LEN, MAX_FRAME_BYTES, MsgType

MAX_STALL_S = 10.0  # a client that takes no message for this long is cut off
# A client refuses a body over MAX_FRAME_BYTES or a list over MAX_CONTAINER_LEN entries.
# Records with log-probabilities are hundreds of bytes each (20 alternatives), so a
# request's records pass the byte bound well before the count bound.
MAX_MERGED_BYTES = MAX_FRAME_BYTES // 4
MAX_MERGED_RECORDS = MAX_CONTAINER_LEN // 16
MAX_BUFFERED_BYTES_PER_REQUEST = 1 << 18  # of packed records waiting for a client: past it the request pauses
RESUME_BYTES_PER_REQUEST = MAX_BUFFERED_BYTES_PER_REQUEST // 2  # under it a paused request goes on


MIN_ROWS_MEASURED = 256  # fewer record rows than this (one step's, mostly) are far below the byte bound


def split_to_fit(rows: list) -> list[list]:
    """Record rows as consecutive parts of at most MAX_MERGED_BYTES packed each (a single
    row is never split); only long lists are packed to measure them."""
    if len(rows) < MIN_ROWS_MEASURED or len(msgpack.packb(rows, use_bin_type=True)) <= MAX_MERGED_BYTES:
        return [rows]
    half = len(rows) // 2
    return split_to_fit(rows[:half]) + split_to_fit(rows[half:])


class Backlog:
    def __init__(self, now_s: float):
        self.messages: deque[list] = deque()  # [message type, body, packed bytes of its records (RECORDS)]
        self.progress_s = now_s  # when the client last took a message
        self._open_records: dict[int, list] = {}  # request id -> its RECORDS entry at the backlog's end
        self.num_bytes_by_request: dict[int, int] = {}  # packed records waiting, of each request that has some

    def add(self, msg_type: MsgType, body: dict) -> None:
        request_id = body.get("request_id")
        if msg_type is MsgType.RECORDS:
            num_bytes = len(msgpack.packb(body["records"], use_bin_type=True))
            self.num_bytes_by_request[request_id] = self.num_bytes_by_request.get(request_id, 0) + num_bytes
            entry = self._open_records.get(request_id)
            if (entry is not None and entry[2] + num_bytes <= MAX_MERGED_BYTES
                    and len(entry[1]["records"]) + len(body["records"]) <= MAX_MERGED_RECORDS):
                entry[1]["records"] += body["records"]
                entry[2] += num_bytes
                return
            body = {**body, "records": list(body["records"])}  # ours to extend; later records merge here
            self._open_records[request_id] = entry = [msg_type, body, num_bytes]
            self.messages.append(entry)
            return
        if request_id is not None:
            self._open_records.pop(request_id, None)  # later records must come after this one
        self.messages.append([msg_type, body, 0])

    def sent_first(self, now_s: float) -> None:
        entry = self.messages.popleft()
        msg_type, body, num_bytes = entry
        if msg_type is MsgType.RECORDS:
            request_id = body["request_id"]
            if self._open_records.get(request_id) is entry:
                del self._open_records[request_id]
            left = self.num_bytes_by_request.pop(request_id) - num_bytes
            if left:
                self.num_bytes_by_request[request_id] = left
        self.progress_s = now_s

    def finished_ids(self) -> list[int]:
        """The requests whose FINISHED waits here: lost if the client is cut off."""
        return [body["request_id"] for msg_type, body, _ in self.messages if msg_type is MsgType.FINISHED]


class RequestPauses:
    """The requests paused for what waits for their client: each past
    MAX_BUFFERED_BYTES_PER_REQUEST of records in its client's backlog, until under
    RESUME_BYTES_PER_REQUEST (or nothing waits for the client any more). `changes` is what
    the worker has to be told: request id -> paused (True) or to go on (False)."""

    def __init__(self):
        self._paused: dict[bytes, set[int]] = {}  # client identity -> its paused requests
        self.changes: dict[int, bool] = {}

    def after_add(self, identity: bytes, backlog: Backlog, msg_type: MsgType, body: dict) -> None:
        if msg_type is not MsgType.RECORDS:
            return
        request_id, paused = body["request_id"], self._paused.setdefault(identity, set())
        if request_id not in paused and backlog.num_bytes_by_request[request_id] > MAX_BUFFERED_BYTES_PER_REQUEST:
            paused.add(request_id)
            self.changes[request_id] = True

    def after_flush(self, identity: bytes, backlog: Backlog | None) -> None:
        """backlog: what still waits for the client, None when nothing does."""
        paused = self._paused.get(identity)
        if paused is None:
            return
        for request_id in list(paused):
            if backlog is None or backlog.num_bytes_by_request.get(request_id, 0) < RESUME_BYTES_PER_REQUEST:
                paused.discard(request_id)
                self.changes[request_id] = False
        if not paused:
            del self._paused[identity]

    def forget(self, identity: bytes) -> None:
        """The client is gone: its requests are cancelled, so pausing them no longer matters."""
        self._paused.pop(identity, None)
