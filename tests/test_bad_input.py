"""Bad input at the front-end: a clear error with a stable code, and nothing else changes."""

import itertools

import msgpack
import pytest
import zmq
from common import GREEDY
from daemonkit import Daemon, RawPeer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbatch.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION, MsgType, pack, unpack

REPLY_TIMEOUT_MS = 5000


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    d = Daemon(tiny_model_path, "--parallel", "2", "--ctx-size", "1024")
    yield d
    assert d.stop() == 0, d.log()
    d.remove_workdir()


@pytest.fixture
def raw(daemon):
    """A bare DEALER socket that said HELLO: what a buggy or hostile client can send next.
    (One that never said HELLO is welcomed when it first speaks: see test_restarts.py.)"""
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    assert ask(sock, pack(MsgType.HELLO, {"version": PROTOCOL_VERSION, "use_ring": False}))[0] is MsgType.WELCOME
    yield sock
    zctx.destroy(linger=0)


def ask(sock, frames) -> tuple[MsgType, dict]:
    sock.send_multipart(frames)
    assert sock.poll(REPLY_TIMEOUT_MS), "no reply"
    return unpack(sock.recv_multipart())


def submit_frames(body, request_id=42) -> list[bytes]:
    return pack(MsgType.SUBMIT, {"request_id": request_id, "body": body})


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]


def grows_when_forwarded() -> list[bytes]:
    """A submit just under the frame limit whose floats are single precision, as another
    msgpack client may send them: forwarded to the worker they take 8 bytes each, and the
    worker's frame would pass the limit."""
    biases = {str(token): 1.5 for token in range(1024)}
    body = {"messages": [], "logit_bias": biases}
    frame_bytes = len(msgpack.packb({"request_id": 42, "body": body}, use_single_float=True))
    while frame_bytes < MAX_FRAME_BYTES - 1024:
        content = "a" * min(1_000_000, MAX_FRAME_BYTES - 1024 - frame_bytes - 32)
        body["messages"].append({"role": "user", "content": content})
        frame_bytes = len(msgpack.packb({"request_id": 42, "body": body}, use_single_float=True))
    return [bytes((MsgType.SUBMIT,)), msgpack.packb({"request_id": 42, "body": body}, use_single_float=True)]


BAD_FRAMES = {
    "garbage bytes": [b"\x00\xff\x13garbage"],
    "truncated": [bytes((MsgType.SUBMIT,)), msgpack.packb({"request_id": 1, "body": {"prompt": "x"}})[:-3]],
    "three frames": [bytes((MsgType.HELLO,)), b"\x80", b"extra"],
    "unknown type": [b"\x7f", msgpack.packb({})],
    "server-only type": pack(MsgType.WELCOME, {}),
    "wrong version": pack(MsgType.HELLO, {"version": PROTOCOL_VERSION + 7, "use_ring": False}),
    "body not a map": [bytes((MsgType.HEALTH,)), msgpack.packb([1, 2, 3])],
    "deep nesting": [bytes((MsgType.HEALTH,)), nested(100_000)],
    "huge declared map": [bytes((MsgType.HEALTH,)), b"\xdf\xff\xff\xff\xff"],
    "invalid utf-8": [bytes((MsgType.SUBMIT,)), b"\x82\xaarequest_id\x01\xa4body\x81\xa6prompt\xa2\xc3\x28"],
    "request_id not int": submit_frames({"prompt": "x"}, request_id="seven"),
    "request_id bool": submit_frames({"prompt": "x"}, request_id=True),
    "request_id negative": submit_frames({"prompt": "x"}, request_id=-1),
    "body not a map field": pack(MsgType.SUBMIT, {"request_id": 5, "body": "prompt"}),
    "negative max_tokens": submit_frames({"prompt": "x", "max_tokens": -1}),
    "huge max_tokens": submit_frames({"prompt": "x", "max_tokens": 2**62}),
    "nan temperature": submit_frames({"prompt": "x", "temperature": float("nan")}),
    "top_p above 1": submit_frames({"prompt": "x", "top_p": 1.01}),
    "empty prompt": submit_frames({"prompt": ""}),
    "unknown role": submit_frames({"messages": [{"role": "robot", "content": "hi"}]}),
    "unknown field": submit_frames({"prompt": "x", "max_new_tokens": 5}),
    "bad grammar": submit_frames({"prompt": "x", "grammar": "root ::= [unclosed"}),
    "grammar nested to crash a parser": submit_frames({"prompt": "x",
                                                       "grammar": "root ::= " + "(" * 30000 + '"a"' + ")" * 30000}),
    "non-string keys": submit_frames({"prompt": "x", b"raw": 1, "max_tokens": 2}),
    "prompt too long": submit_frames({"prompt": "long " * 1200}),
    "too large once forwarded": grows_when_forwarded(),
    "cancel of unknown id": pack(MsgType.CANCEL, {"request_id": 99}),
    "fetch of unknown id": pack(MsgType.FETCH, {"request_id": 99, "from_index": 0}),
}
EXPECTED_CODES = {
    "wrong version": "version_mismatch", "prompt too long": "prompt_too_long",
    "cancel of unknown id": "not_found", "fetch of unknown id": "not_found",
}
# Submits of request 42 whose body is wrong: the error names the request all the same.
NAMES_THE_REQUEST = {"non-string keys", "unknown field", "bad grammar", "negative max_tokens", "prompt too long",
                     "too large once forwarded"}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_bad_message_gets_a_coded_error_and_changes_nothing(daemon, raw, name):
    with daemon.client() as other:
        pid_before = other.health()["worker_pid"]
        stream = other.stream(prompt="bystander", max_tokens=60, **GREEDY)
        first = next(stream)
        msg_type, reply = ask(raw, BAD_FRAMES[name])
        rest = list(stream)
        assert other.health()["worker_pid"] == pid_before
    assert msg_type is MsgType.ERROR
    assert reply["code"] == EXPECTED_CODES.get(name, "invalid_request") and reply["message"]
    if name in NAMES_THE_REQUEST:
        assert reply.get("request_id") == 42, reply
    tokens = first.token_ids + sum((c.token_ids for c in rest), [])
    assert rest[-1].finish_reason == "length" and len(tokens) == 60


def test_oversized_frame_is_dropped_without_harm(daemon, raw):
    raw.send_multipart([bytes((MsgType.HEALTH,)), b"\x00" * (MAX_FRAME_BYTES + 4096)])
    with daemon.client() as client:  # the daemon still serves everyone else
        assert client.generate(prompt="after", max_tokens=5, **GREEDY).finish_reason == "length"


def test_a_client_cannot_touch_another_clients_request(daemon):
    with daemon.client() as owner, RawPeer(daemon.endpoint) as intruder:
        stream = owner.submit(prompt="mine", max_tokens=80, **GREEDY)
        replies = {}
        for msg_type, body in ((MsgType.CANCEL, {}), (MsgType.FETCH, {"from_index": 0})):
            intruder.send(msg_type, {"request_id": stream.request_id, **body})
            replies[msg_type] = intruder.recv()
        chunks = list(owner.read(stream))
    for msg_type, (reply_type, reply) in replies.items():
        assert reply_type is MsgType.ERROR, f"{msg_type.name} of another client's request was answered: {reply}"
        assert reply["code"] == "not_found" and reply["request_id"] == stream.request_id
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 80
    assert len(sum((c.token_ids for c in chunks), [])) == 80


REPLY_TYPES = {MsgType.WELCOME, MsgType.RECORDS, MsgType.FINISHED, MsgType.ERROR, MsgType.HEALTH_REPLY,
               MsgType.STATS_REPLY}
ERROR_CODES = {"invalid_request", "version_mismatch", "not_found", "prompt_too_long"}
PROBE_NONCES = itertools.count(1 << 62)  # far from the small integers the fuzzer favours
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)  # msgpack cannot pack lone surrogates


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.one_of(
    st.binary(max_size=64),
    st.sampled_from([bytes((t,)) for t in MsgType] + [b"\x00", b"\xff"]),
    st.builds(msgpack.packb, st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | TEXT | st.binary(max_size=20),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children, max_size=4),
        max_leaves=12)),
), min_size=1, max_size=3))
def test_fuzzed_frames_never_break_the_daemon(daemon, raw, frames):
    raw.send_multipart(frames)
    # A health probe after the frames: its reply proves the front-end handled all of them
    # and still answers, on the same worker. Everything before it must be a well-formed
    # message of the protocol (errors, or answers to frames that happened to be valid).
    nonce = next(PROBE_NONCES)
    raw.send_multipart(pack(MsgType.HEALTH, {"nonce": nonce}))
    while True:
        assert raw.poll(REPLY_TIMEOUT_MS), f"the daemon stopped answering after {frames!r}"
        msg_type, reply = unpack(raw.recv_multipart())
        assert msg_type in REPLY_TYPES, msg_type
        if msg_type is MsgType.ERROR:
            assert reply["code"] in ERROR_CODES and reply["message"], reply
        if msg_type is MsgType.HEALTH_REPLY and reply.get("nonce") == nonce:
            break
    assert reply["status"] == "ok" and reply["worker_pid"] == daemon.health["worker_pid"]
    assert daemon.process.poll() is None


def test_after_fuzzing_a_normal_request_still_succeeds(daemon):
    with daemon.client() as client:
        health = client.health()
        result = client.generate(prompt="still fine", max_tokens=12, **GREEDY)
    assert health["status"] == "ok" and result.finish_reason == "length" and len(result.token_ids) == 12
