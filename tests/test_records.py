"""The writer's whole-step framing (frame_events) gives exactly the records that each
event's records() defines, byte for byte, on the packed path and the per-record one."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cbatch.ipc.records import FINISH_CODES, RECORD_DTYPE, RECORD_STRUCT, TokenEvent, frame_events

texts = st.text(st.characters(codec="utf-8"), max_size=40)
one_token_events = st.builds(
    TokenEvent, st.integers(0, (1 << 63) - 1), st.lists(st.integers(-1, (1 << 31) - 1), min_size=1, max_size=1),
    st.text(st.characters(codec="utf-8"), max_size=8), st.sampled_from(list(FINISH_CODES)),
    index=st.integers(0, 1 << 30))
any_events = st.builds(
    TokenEvent, st.integers(0, (1 << 63) - 1), st.lists(st.integers(-1, (1 << 31) - 1), max_size=3), texts,
    st.sampled_from(list(FINISH_CODES)), index=st.integers(0, 1 << 30))


def one_by_one(events: list[TokenEvent]) -> bytes:
    return b"".join(RECORD_STRUCT.pack(0, *r[:5], len(r.text), r.count, r.text) for e in events for r in e.records())


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(one_token_events, max_size=70), st.lists(any_events, max_size=10)))
def test_a_step_is_framed_as_its_events_records(events):
    framed, counts = frame_events(events)
    assert framed.dtype == RECORD_DTYPE
    assert framed.tobytes() == one_by_one(events)
    assert counts == [len(e.records()) for e in events]


def test_a_decode_step_takes_the_packed_path_and_short_text_is_zero_padded():
    events = [TokenEvent(7, [11], "é"), TokenEvent(8, [12], "x" * 32, "length", index=4)]
    framed, counts = frame_events(events)
    assert counts == [1, 1]
    assert framed["text"][0].tobytes() == "é".encode() + bytes(30)
    assert framed["count"].tolist() == [0, 5] and framed["flags"].tolist() == [0, 1]
    assert np.array_equal(framed["token_id"], [11, 12])
