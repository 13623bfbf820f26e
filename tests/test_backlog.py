"""What waits for a relayed client that reads slower than the daemon sends: a request's
records merge into few messages, each one within what a client unpacks, none lost.
(Through a daemon, one request's records pass 4 MiB only after about 13,500 tokens with
20 log-probabilities each: minutes of decoding on a small host, so the backlog is driven
directly here, with records shaped as the front-end relays them.)"""

from cbatch.protocol import MAX_FRAME_BYTES, MsgType, pack, unpack
from cbatch.workers.daemon.backlog import MAX_MERGED_BYTES, MAX_MERGED_RECORDS, Backlog, split_to_fit

NUM_TOP = 20  # log-probabilities asked for: the widest record there is


def logprobs_row(index: int) -> list:
    """A relayed record with its log-probabilities entry, as the front-end sends it."""
    top = [[token_id, b"piece %d" % token_id, -1.5 - token_id / 100] for token_id in range(NUM_TOP)]
    return [index, 300 + index % 200, 0, 0, 0, "text", [300 + index % 200, b"piece", -0.25, top]]


def test_a_lagging_clients_records_merge_within_the_clients_frame_bound():
    """More than 4 MiB of one request's records wait: they go out as several messages, each
    of which the client unpacks, in order and whole, with the finish after them."""
    backlog = Backlog(0.0)
    num_records = 0
    while num_records * 450 < 2 * MAX_FRAME_BYTES:  # rows are about 450 bytes packed
        backlog.add(MsgType.RECORDS, {"request_id": 7, "records": [logprobs_row(num_records)]})
        num_records += 1
    backlog.add(MsgType.FINISHED, {"request_id": 7, "num_records": num_records})
    indices, sizes = [], []
    while backlog.messages:
        msg_type, body, _ = backlog.messages[0]
        frames = pack(msg_type, body)
        sizes.append(len(frames[1]))
        got_type, got = unpack(frames)  # what the client does: it refuses a body over its bound
        backlog.sent_first(1.0)
        if got_type is MsgType.RECORDS:
            indices += [row[0] for row in got["records"]]
            assert len(got["records"]) <= MAX_MERGED_RECORDS
    assert indices == list(range(num_records)) and got_type is MsgType.FINISHED
    assert 3 <= len(sizes) <= 4 * MAX_FRAME_BYTES // MAX_MERGED_BYTES  # merged, not one message per step
    assert max(sizes) <= MAX_MERGED_BYTES + 1024


def test_a_long_fetch_reply_is_split_within_the_clients_frame_bound():
    """A FETCH of 4096 records with long log-probability pieces would pass the bound in one
    reply: it goes as several, in order, each of which a client unpacks."""
    def long_pieces(row: list) -> list:
        token_id, _, logprob, top = row[6]
        return [*row[:6], [token_id, b"p" * 40, logprob, [[t, b"q" * 40, lp] for t, _, lp in top]]]

    rows = [long_pieces(logprobs_row(i)) for i in range(4096)]
    parts = split_to_fit(rows)
    assert len(parts) > 1 and [row for part in parts for row in part] == rows
    for part in parts:
        frames = pack(MsgType.RECORDS, {"request_id": 1, "records": part})
        assert sum(map(len, frames)) <= MAX_FRAME_BYTES
        unpack(frames)
    assert split_to_fit(rows[:8]) == [rows[:8]]  # a step's few rows are sent as they are, unmeasured


def test_a_request_past_the_bound_is_paused_and_goes_on_once_its_client_catches_up():
    """Only the request whose records pile up is paused; it goes on once what waits for it
    falls under the resume bound, or when nothing waits for its client any more."""
    from cbatch.workers.daemon.backlog import MAX_BUFFERED_BYTES_PER_REQUEST, RESUME_BYTES_PER_REQUEST, RequestPauses

    backlog, pauses, num_bytes = Backlog(0.0), RequestPauses(), 0
    while num_bytes <= MAX_BUFFERED_BYTES_PER_REQUEST:
        body = {"request_id": 7, "records": [logprobs_row(num_bytes)]}
        backlog.add(MsgType.RECORDS, body)
        pauses.after_add(b"slow", backlog, MsgType.RECORDS, body)
        other = {"request_id": 8, "records": [logprobs_row(0)]}
        backlog.add(MsgType.RECORDS, other)
        pauses.after_add(b"slow", backlog, MsgType.RECORDS, other)
        num_bytes = backlog.num_bytes_by_request[7]
    assert pauses.changes == {7: True}
    pauses.changes.clear()
    pauses.after_flush(b"slow", backlog)
    assert pauses.changes == {}  # nothing was sent: still past the bound
    while backlog.num_bytes_by_request.get(7, 0) >= RESUME_BYTES_PER_REQUEST:
        backlog.sent_first(1.0)
    pauses.after_flush(b"slow", backlog)
    assert pauses.changes == {7: False}
    assert sum(backlog.num_bytes_by_request.values()) == sum(entry[2] for entry in backlog.messages)
