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
        self.messages: deque[tuple[MsgType, dict]] = deque()
        self.progress_s = now_s  # when the client last took a message
        # request id -> its RECORDS body at the backlog's end, and the packed size of its records
        self._open_records: dict[int, tuple[dict, int]] = {}

    def add(self, msg_type: MsgType, body: dict) -> None:
        request_id = body.get("request_id")
        if msg_type is MsgType.RECORDS:
            num_bytes = len(msgpack.packb(body["records"], use_bin_type=True))
            open_body, num_open_bytes = self._open_records.get(request_id, (None, 0))
            if (open_body is not None and num_open_bytes + num_bytes <= MAX_MERGED_BYTES
                    and len(open_body["records"]) + len(body["records"]) <= MAX_MERGED_RECORDS):
                open_body["records"] += body["records"]
                self._open_records[request_id] = open_body, num_open_bytes + num_bytes
                return
            body = {**body, "records": list(body["records"])}  # ours to extend; later records merge here
            self._open_records[request_id] = body, num_bytes
        elif request_id is not None:
            self._open_records.pop(request_id, None)  # later records must come after this one
        self.messages.append((msg_type, body))

    def sent_first(self, now_s: float) -> None:
        msg_type, body = self.messages.popleft()
        if msg_type is MsgType.RECORDS and self._open_records.get(body["request_id"], (None,))[0] is body:
            del self._open_records[body["request_id"]]
        self.progress_s = now_s

    def finished_ids(self) -> list[int]:
        """The requests whose FINISHED waits here: lost if the client is cut off."""
        return [body["request_id"] for msg_type, body in self.messages if msg_type is MsgType.FINISHED]
