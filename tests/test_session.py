"""The client's session against a real ring segment, without a daemon: assembly and corruption."""

import pytest
from ringkit import publish

from cbatch.client.session import Session
from cbatch.errors import CbatchError
from cbatch.ipc.records import FINISH_LENGTH
from cbatch.ipc.ring import RingWriter
from cbatch.protocol import MsgType, pack


def make_session(ring) -> tuple[Session, list]:
    """A session that took the daemon's welcome to read this ring (no worker ticks: the
    tests read with is_pumped, on their own thread)."""
    sent = []
    session = Session(sent.append, use_ring=True)
    session.on_frames(pack(MsgType.WELCOME, {"use_ring": True, "ring_name": ring.name,
                                             "tick_endpoint": f"ipc://{ring.name}-no-ticks"}))
    return session, sent


def test_ring_records_and_finish_make_one_completion(ring):
    session, _ = make_session(ring)
    stream = session.submit({"prompt": "x"})
    writer = RingWriter(ring)
    text = "héllo wörld, a text longer than one record's 32 bytes".encode()
    next_index = publish(writer, stream.request_id, 0, [5, 6], text)
    next_index = publish(writer, stream.request_id, next_index, [7], b"!", FINISH_LENGTH)
    session.read_ring(is_pumped=True)
    session.on_frames(pack(MsgType.FINISHED, {"request_id": stream.request_id, "finish_reason": "length",
                                              "usage": {"prompt_tokens": 2, "completion_tokens": 3},
                                              "num_records": next_index, "error": None}))
    completion = stream.completion()
    assert completion.token_ids == [5, 6, 7] and completion.text == text.decode() + "!"
    session.close()


def test_finish_with_records_missing_asks_the_front_end_for_them(ring):
    session, sent = make_session(ring)
    stream = session.submit({"prompt": "x"})
    session.on_frames(pack(MsgType.FINISHED, {"request_id": stream.request_id, "finish_reason": "length",
                                              "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                                              "num_records": 1, "error": None}))
    assert not stream.is_done
    assert sent[-1][0] == bytes((MsgType.FETCH,))
    session.on_frames(pack(MsgType.RECORDS, {"request_id": stream.request_id, "records": [[0, 9, 3, 2, 1, b"z"]]}))
    assert stream.is_done and stream.completion().token_ids == [9]
    session.close()


def test_corrupt_ring_record_is_a_coded_error(ring):
    session, _ = make_session(ring)
    stream = session.submit({"prompt": "x"})
    publish(RingWriter(ring), stream.request_id, 0, [5], b"ok")
    ring.records["text_len"][0] = 200  # no record holds more than 32 bytes of text
    with pytest.raises(CbatchError) as err:
        session.read_ring(is_pumped=True)
    assert err.value.code == "internal" and "corrupt" in err.value.message
    session.close()


def test_liveness_is_judged_per_request_while_others_stream():
    """A request whose reply was lost is named in a ping after LIVENESS_S even though
    records of another request keep arriving, and fails once the daemon calls it lost."""
    from cbatch.client.session import LIVENESS_S
    from cbatch.errors import UNAVAILABLE
    from cbatch.protocol import unpack

    sent, now = [], [100.0]
    session = Session(sent.append, use_ring=False, clock=lambda: now[0])
    lost, busy = session.submit({"prompt": "a"}), session.submit({"prompt": "b"})
    start_s = now[0]
    for step in range(1, int(LIVENESS_S / 0.25)):  # the busy request hears every quarter second
        now[0] = start_s + step * 0.25
        session.on_frames(pack(MsgType.RECORDS, {"request_id": busy.request_id,
                                                 "records": [[step - 1, step, 0, 0, 0, b"x"]]}))
        session.check_liveness(now[0])
    assert not any(unpack(frames)[0] is MsgType.HEALTH for frames in sent)
    now[0] = start_s + LIVENESS_S + 0.1
    session.check_liveness(now[0])
    msg_type, ping = unpack(sent[-1])
    assert msg_type is MsgType.HEALTH and ping["request_ids"] == [lost.request_id]  # busy heard lately
    session.on_frames(pack(MsgType.HEALTH_REPLY, {"nonce": ping["nonce"], "status": "ok",
                                                  "lost_request_ids": [lost.request_id]}))
    assert lost.is_done and lost.error.code == UNAVAILABLE and not busy.is_done


def test_a_daemon_that_stops_answering_fails_waiting_streams_within_5_s_without_raising():
    from cbatch.client.session import SAFETY_POLL_S
    from cbatch.errors import UNAVAILABLE
    from cbatch.protocol import unpack

    sent = []
    session = Session(sent.append, use_ring=False)
    stream = session.submit({"prompt": "a"})
    last_heard_s = now_s = stream.heard_s
    while not stream.is_done:  # the driver's rounds while the daemon is silent
        now_s += SAFETY_POLL_S
        session.check_liveness(now_s)
    assert now_s - last_heard_s <= 5.0 + SAFETY_POLL_S
    assert sum(unpack(frames)[0] is MsgType.HEALTH for frames in sent) >= 2  # given up after pings, not one
    assert stream.error.code == UNAVAILABLE and session.failure is not None
    with pytest.raises(CbatchError) as err:  # a new submit fails at once instead of waiting again
        session.submit({"prompt": "b"})
    assert err.value.code == UNAVAILABLE


def test_a_draining_daemon_makes_the_next_submits_fail_at_once():
    from cbatch.errors import SHUTTING_DOWN

    sent = []
    session = Session(sent.append, use_ring=False)
    stream = session.submit({"prompt": "a"})
    session.on_frames(pack(MsgType.ERROR, {"code": SHUTTING_DOWN, "message": "draining",
                                           "request_id": stream.request_id}))
    assert stream.error.code == SHUTTING_DOWN
    num_sent = len(sent)
    with pytest.raises(CbatchError) as err:
        session.submit({"prompt": "b"})
    assert err.value.code == SHUTTING_DOWN and len(sent) == num_sent


def test_a_body_the_front_end_would_refuse_fails_before_it_is_sent():
    from cbatch.errors import INVALID_REQUEST

    sent = []
    session = Session(sent.append, use_ring=False)
    with pytest.raises(CbatchError) as err:
        session.submit({"prompt": "a", "logit_bias": {1: 2.0}})  # a non-string key
    assert err.value.code == INVALID_REQUEST and sent == [] and session.streams == {}


def test_a_failed_decode_ends_its_stream_with_the_workers_reason():
    """Tokens produced before the failure still reach the caller; then the stream ends with
    a decode_failed error carrying the worker's message, never with a finished chunk."""
    from cbatch.errors import DECODE_FAILED

    session = Session([].append, use_ring=False)
    stream = session.submit({"prompt": "a"})
    session.on_frames(pack(MsgType.RECORDS, {"request_id": stream.request_id,
                                             "records": [[0, 9, 0, 0, 0, b"z"], [1, -1, 0, 4, 2, b""]]}))
    assert not stream.is_done  # the finish has not arrived yet
    session.on_frames(pack(MsgType.FINISHED, {"request_id": stream.request_id, "finish_reason": "error",
                                              "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                                              "num_records": 2, "error": "llama_decode failed with status -3"}))
    assert stream.take().token_ids == [9]
    with pytest.raises(CbatchError) as err:
        stream.take()
    assert err.value.code == DECODE_FAILED and err.value.message == "llama_decode failed with status -3"
    assert stream.is_drained
    with pytest.raises(CbatchError) as again:
        stream.completion()
    assert again.value is err.value


def test_a_request_that_failed_ends_once_whatever_else_arrives_for_it():
    """A failed decode's finish, then an error reply for the same request (a cancel the
    daemon no longer knows, say): the stream has one terminal item, the first error."""
    session = Session([].append, use_ring=False)
    stream = session.submit({"prompt": "a"})
    session.on_frames(pack(MsgType.FINISHED, {"request_id": stream.request_id, "finish_reason": "error",
                                              "usage": {"prompt_tokens": 1, "completion_tokens": 0},
                                              "num_records": 0, "error": "llama_decode failed with status -3"}))
    session.on_frames(pack(MsgType.ERROR, {"request_id": stream.request_id, "code": "not_found", "message": "gone"}))
    with pytest.raises(CbatchError) as err:
        stream.take()
    assert err.value.code == "decode_failed" and stream.is_drained
