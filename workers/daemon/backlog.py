"""Messages waiting for a client that reads slower than the daemon sends.

A client's ZeroMQ queue fills when it stops reading for a moment, or when one caller of
a client that serves many (the HTTP server) asks for a burst of replies. Cancelling all
of such a client's requests would punish every caller for one; dropping messages would
lose tokens. So what does not fit waits here, and a request's consecutive RECORDS merge
into one message (as vLLM's output collector merges a lagging consumer's outputs): the
backlog holds at most one RECORDS message per request between its other messages, and
grows with the requests, not with the steps. It drains as the client reads. Only a client
that takes nothing for MAX_STALL_S is cut off (the front-end then cancels its requests).
"""

from collections import deque

from cbatch.protocol import MsgType

MAX_STALL_S = 10.0  # a client that takes no message for this long is cut off


class Backlog:
    def __init__(self, now_s: float):
        self.messages: deque[tuple[MsgType, dict]] = deque()
        self.progress_s = now_s  # when the client last took a message
        self._open_records: dict[int, dict] = {}  # request id -> its RECORDS body at the backlog's end

    def add(self, msg_type: MsgType, body: dict) -> None:
        request_id = body.get("request_id")
        if msg_type is MsgType.RECORDS:
            open_body = self._open_records.get(request_id)
            if open_body is not None:
                open_body["records"] += body["records"]
                return
            body = {**body, "records": list(body["records"])}  # ours to extend
            self._open_records[request_id] = body
        elif request_id is not None:
            self._open_records.pop(request_id, None)  # later records must come after this one
        self.messages.append((msg_type, body))

    def sent_first(self, now_s: float) -> None:
        msg_type, body = self.messages.popleft()
        if msg_type is MsgType.RECORDS and self._open_records.get(body["request_id"]) is body:
            del self._open_records[body["request_id"]]
        self.progress_s = now_s

    def finished_ids(self) -> list[int]:
        """The requests whose FINISHED waits here: lost if the client is cut off."""
        return [body["request_id"] for msg_type, body in self.messages if msg_type is MsgType.FINISHED]
