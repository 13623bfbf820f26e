"""Released text: whole UTF-8 characters only, and never any part of a stop string."""

import codecs

from hypothesis import given, settings
from hypothesis import strategies as st

from cbatch.workers.engine.text_stream import TextStream


def push_all(stream, pieces):
    return [stream.push(p) for p in pieces]


def test_multibyte_characters_are_held_until_complete():
    data = "aé✓😀".encode()
    stream = TextStream()
    released = push_all(stream, [data[i : i + 1] for i in range(len(data))])
    assert "".join(released) + stream.finish() == "aé✓😀"
    assert all("\ufffd" not in r for r in released)
    assert released[:3] == ["a", "", "é"]


def test_stop_string_across_pieces_is_cut_and_never_released():
    stream = TextStream(("STOP",))
    released = push_all(stream, [b"one S", b"T", b"O", b"P two"])
    assert "".join(released) == "one " and stream.is_stopped and stream.stop_string == "STOP"


def test_near_miss_is_released_once_it_cannot_match():
    stream = TextStream(("abc",))
    released = push_all(stream, [b"xa", b"b", b"d"])
    assert released == ["x", "", "abd"] and not stream.is_stopped and stream.stop_string == ""


def test_earliest_of_several_stop_strings_wins():
    stream = TextStream(("world", "lo w"))
    assert stream.push(b"hello world") == "hel" and stream.is_stopped and stream.stop_string == "lo w"


def test_incomplete_character_at_the_end_becomes_a_replacement():
    stream = TextStream()
    assert stream.push(b"ok\xe2\x9c") == "ok"
    assert stream.finish() == "\ufffd"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=4), st.sampled_from([b"ab", b" the", b"\xc3", b"\xa9", b"\xf0\x9f"])),
                max_size=30))
def test_without_stop_strings_each_piece_releases_what_a_utf8_decoder_does(pieces):
    # Such a stream passes ASCII pieces through when no bytes are pending: it must release,
    # piece by piece, exactly what the incremental decoder releases.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    stream = TextStream()
    assert push_all(stream, pieces) == [decoder.decode(piece) for piece in pieces]
    assert stream.finish() == decoder.decode(b"", final=True)
