"""The client's session against a real ring segment, without a daemon: assembly and corruption."""

import os

import pytest

from cbatch.errors import CbatchError
from cbatch.ipc.ring import FINISH_LENGTH, RingReader, RingWriter, attach_ring, create_ring
from cbatch.protocol import MsgType, pack
from cbatch.session import Session


@pytest.fixture
def ring():
    owner = create_ring(f"cbatch-test-session-{os.getpid()}", 64)
    yield owner
    owner.close()
    owner.unlink()


def make_session(ring) -> tuple[Session, list]:
    sent = []
    session = Session(sent.append, use_ring=True)
    session._ring = attach_ring(ring.name)
    session.reader = RingReader(session._ring)
    return session, sent


def test_ring_records_and_finish_make_one_completion(ring):
    session, _ = make_session(ring)
    stream = session.submit({"prompt": "x"})
    writer = RingWriter(ring)
    text = "héllo wörld, a text longer than one record's 32 bytes".encode()
    next_index = writer.publish(stream.request_id, 0, [5, 6], text, is_first=True)
    next_index = writer.publish(stream.request_id, next_index, [7], b"!", FINISH_LENGTH)
    session.read_ring()
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
    RingWriter(ring).publish(stream.request_id, 0, [5], b"ok", is_first=True)
    ring.records["text_len"][0] = 200  # no record holds more than 32 bytes of text
    with pytest.raises(CbatchError) as err:
        session.read_ring()
    assert err.value.code == "internal" and "corrupt" in err.value.message
    session.close()
