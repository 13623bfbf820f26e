"""The front-end's request table and the worker messages, without sockets or a model."""

import pytest

from cbatch.errors import INVALID_REQUEST, NOT_FOUND, QUEUE_FULL, CbatchError
from cbatch.ipc.records import TokenEvent, frame_events, record_request_ids, relay_rows
from cbatch.params import parse_request
from cbatch.workers.daemon.request_table import RequestTable, TrackedRequest
from cbatch.workers.messages import WorkerEvents, WorkerReject, WorkerSubmit, decode, encode

FINISH = {"finish_reason": "stop"}


def test_add_refuses_ids_in_use_and_a_full_table():
    table = RequestTable(max_in_flight=(2, 2), retention_s=60.0)
    table.add(TrackedRequest(1, b"a", is_relayed=False))
    with pytest.raises(CbatchError) as err:
        table.add(TrackedRequest(1, b"b", is_relayed=False))
    assert err.value.code == INVALID_REQUEST
    table.add(TrackedRequest(2, b"a", is_relayed=False))
    with pytest.raises(CbatchError) as err:
        table.add(TrackedRequest(3, b"a", is_relayed=False))
    assert err.value.code == QUEUE_FULL
    table.finish(table.active[1], FINISH, now_s=0.0)
    with pytest.raises(CbatchError) as err:  # a retained id is still in use
        table.add(TrackedRequest(1, b"a", is_relayed=False))
    assert err.value.code == INVALID_REQUEST
    table.add(TrackedRequest(3, b"a", is_relayed=False))  # the finished one freed its place


def test_each_priority_has_its_own_bound_and_the_refusal_names_its_flag():
    table = RequestTable(max_in_flight=(1, 2), retention_s=60.0)
    table.add(TrackedRequest(1, b"a", is_relayed=False, is_batch=True))
    table.add(TrackedRequest(2, b"a", is_relayed=False, is_batch=True))
    with pytest.raises(CbatchError) as err:
        table.add(TrackedRequest(3, b"a", is_relayed=False, is_batch=True))
    assert err.value.code == QUEUE_FULL and err.value.message.endswith("raise --max-batch-queue")
    table.add(TrackedRequest(4, b"b", is_relayed=False))  # a full batch bound leaves the interactive one
    with pytest.raises(CbatchError) as err:
        table.add(TrackedRequest(5, b"b", is_relayed=False))
    assert err.value.message == "1 interactive request in flight; retry later or raise --max-queue"
    table.fail(table.active[1], QUEUE_FULL, 0.0)  # an ended batch request frees a batch place only
    table.add(TrackedRequest(6, b"a", is_relayed=False, is_batch=True))
    assert table.num_active_by_priority == [1, 2]


def test_only_the_owner_finds_its_request_and_retention_expires_it():
    table = RequestTable(max_in_flight=(8, 8), retention_s=10.0)
    table.add(TrackedRequest(1, b"a", is_relayed=False))
    assert table.owned(b"a", 1).request_id == 1
    with pytest.raises(CbatchError) as err:
        table.owned(b"b", 1)
    assert err.value.code == NOT_FOUND
    table.finish(table.active[1], FINISH, now_s=100.0)
    assert table.owned(b"a", 1).finish == FINISH  # retained
    table.add(TrackedRequest(2, b"a", is_relayed=False))
    table.finish(table.active[2], FINISH, now_s=111.0)  # 1 finished more than 10 s before this
    assert table.get(1) is None and table.get(2) is not None
    assert table.num_ended_by_outcome == {"stop": 2}
    table.expire(now_s=122.0)  # with nothing finishing, as on an idle daemon
    assert table.get(2) is None


def test_owed_finishes_are_per_owner_and_forgotten_at_expiry():
    table = RequestTable(max_in_flight=(8, 8), retention_s=10.0)
    for request_id, owner in ((1, b"a"), (2, b"a"), (3, b"b")):
        table.add(TrackedRequest(request_id, owner, is_relayed=False))
        tracked = table.active[request_id]
        table.finish(tracked, FINISH, now_s=0.0)
        table.set_delivered(tracked, owner == b"b")
    assert [tracked.request_id for tracked in table.owed_to(b"a")] == [1, 2] and table.owed_to(b"b") == []
    table.set_delivered(table.get(1), True)
    assert [tracked.request_id for tracked in table.owed_to(b"a")] == [2]
    table.add(TrackedRequest(4, b"c", is_relayed=False))
    table.finish(table.active[4], FINISH, now_s=20.0)  # expires 1-3
    assert table.owed_to(b"a") == []


def test_failed_requests_are_counted_by_code_and_not_kept():
    table = RequestTable(max_in_flight=(8, 8), retention_s=10.0)
    table.add(TrackedRequest(1, b"a", is_relayed=False, submit=[b"\x01", b"held"]))
    assert table.active[1].is_held
    table.fail(table.active[1], "worker_restarted", 0.0)
    assert table.get(1) is None and table.num_ended_by_outcome == {"worker_restarted": 1}


def test_worker_messages_round_trip_as_their_structs():
    step = [TokenEvent(7, [1, 2], "hi", logprobs=[{"a": 1}, {"b": 2}]),
            TokenEvent(8, [], "", "stop", {"prompt_tokens": 1}, index=3)]
    events = WorkerEvents.of_step(step, frame_events(step)[0], stats={"num_active": 1})
    submit = WorkerSubmit(parse_request(5, {"prompt": "x", "stop": "\n", "logit_bias": {"3": 1}}), 12.5)
    for message in (events, submit, WorkerReject(5, "invalid_request", "bad")):
        assert decode(encode(message)) == message
    assert record_request_ids(events.records) == [7, 7, 8]
    assert [row[:5] for row in relay_rows(events.records)] == [[0, 1, 0, 0, 0], [1, 2, 0, 0, 0], [3, -1, 1, 1, 4]]
    assert events.ends == [[8, "stop", {"prompt_tokens": 1}, None, "", ""]]
    assert events.logprobs == [[7, 0, [{"a": 1}, {"b": 2}]]]
