"""Each request's records as the front-end keeps them, and their relay over ZeroMQ.

The worker writes a step's token records to the ring and sends the front-end the same
bytes. The front-end keeps them per request (one slice per record, no per-token object),
so that a reader the ring lapped can FETCH them, and sends them as RECORDS replies to the
owners that do not read the ring: clients on another host, requests that asked for
log-probabilities (which do not fit the ring's records: they travel as a seventh column),
and finishes the front-end made itself (the worker never wrote those to the ring).
Invariant: a request's records are kept in index order (its record N is the N-th slice), so
what a FETCH asks from an index on is one slice of `TrackedRequest.records`.
"""

from cbatch.ipc.records import RECORD_SIZE_BYTES, record_request_ids, relay_rows
from cbatch.protocol import MsgType
from cbatch.workers.daemon.backlog import split_to_fit
from cbatch.workers.daemon.client_link import ClientLink
from cbatch.workers.daemon.request_table import TrackedRequest
from cbatch.workers.messages import WorkerEvents

MAX_RECORDS_PER_MESSAGE = 4096  # RECORDS replies are split to stay far inside the unpack limits


class RecordRelay:
    def __init__(self, clients: ClientLink):
        self.clients = clients

    def keep_step(self, active: dict[int, TrackedRequest], step: WorkerEvents, *, relay_all: bool) -> None:
        """A step's records and log-probabilities joined to their requests', then the new
        records relayed to the owners that do not read the ring (to every owner with
        `relay_all`: a finish the front-end made itself). Records of a request no longer
        active (failed in a worker restart, or rejected) are dropped."""
        data, relayed = step.records, {}
        for position, request_id in enumerate(record_request_ids(data)):
            tracked = active.get(request_id)
            if tracked is None:
                continue
            if (tracked.is_relayed or relay_all) and request_id not in relayed:
                relayed[request_id] = (tracked, tracked.num_records)
            tracked.records += data[position * RECORD_SIZE_BYTES:(position + 1) * RECORD_SIZE_BYTES]
        for request_id, first_index, entries in step.logprobs:
            tracked = active.get(request_id)
            if tracked is not None and tracked.logprobs is not None:
                tracked.logprobs.update(zip(range(first_index, first_index + len(entries)), entries))
        for tracked, first_index in relayed.values():
            self.send(tracked, first_index)

    def send(self, tracked: TrackedRequest, first_index: int, *, even_if_empty: bool = False) -> None:
        """Its records from first_index on. Even an empty answer matters to a FETCH: it lets
        the reader resume the ring."""
        num_records = tracked.num_records
        if first_index >= num_records and even_if_empty:
            self._send_part(tracked, [])
        for at in range(first_index, num_records, MAX_RECORDS_PER_MESSAGE):
            end = min(at + MAX_RECORDS_PER_MESSAGE, num_records)
            rows = relay_rows(tracked.records[at * RECORD_SIZE_BYTES:end * RECORD_SIZE_BYTES])
            if tracked.logprobs is not None:  # a seventh column: the token's logprobs entry
                rows = [[*row, tracked.logprobs.get(row[0])] for row in rows]
            for part in split_to_fit(rows):  # within the client's frame bound, however long the pieces
                self._send_part(tracked, part)

    def _send_part(self, tracked: TrackedRequest, rows: list) -> None:
        self.clients.send(tracked.owner, MsgType.RECORDS, {"request_id": tracked.request_id, "records": rows})
