"""Released text: whole UTF-8 characters only, and never any part of a stop string."""

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
    assert "".join(released) == "one " and stream.is_stopped


def test_near_miss_is_released_once_it_cannot_match():
    stream = TextStream(("abc",))
    released = push_all(stream, [b"xa", b"b", b"d"])
    assert released == ["x", "", "abd"] and not stream.is_stopped


def test_earliest_of_several_stop_strings_wins():
    stream = TextStream(("world", "lo w"))
    assert stream.push(b"hello world") == "hel" and stream.is_stopped


def test_incomplete_character_at_the_end_becomes_a_replacement():
    stream = TextStream()
    assert stream.push(b"ok\xe2\x9c") == "ok"
    assert stream.finish() == "\ufffd"
