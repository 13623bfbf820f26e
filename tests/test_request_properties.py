"""Property: whatever combination of the request fields cbatch accepts a caller sends, the
answer is a success or a refusal with a stable 4xx code, the decode worker's pid never
changes, and another caller's stream runs to its end. Drawn bodies go through a real daemon
over the native client and over HTTP (completions and chat, with json_schema, tools and
tool_choice), mostly valid values with some out of range."""

import httpx
import pytest
from daemonkit import serve_module
from httpkit import HttpDaemon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_worker_survives import NUL_ONLY, ONE_A, SCHEMA, TOOL, Bystander

from cbatch.errors import CbatchError

# The codes a request body alone may earn (cbatch.errors): never decode_failed, internal,
# worker_restarted or unavailable.
REQUEST_CODES = {"invalid_request", "prompt_too_long", "deadline_exceeded"}
NUM_EXAMPLES = 80
GRAMMARS = [ONE_A, NUL_ONLY, 'root ::= [a-z]+', 'root ::= "x" root | "y"', 'root ::= "ab" | "abc"',
            'root ::= [^\\x00-\\x7f]*']
EOS_ID = 2  # the tiny model's end of sequence
# One out-of-range value, put over a drawn body about half the time.
INVALID_FIELDS = [("max_tokens", 0), ("temperature", -1.0), ("top_p", 1.5), ("seed", 2 ** 33), ("stop", [""]),
                  ("grammar", "not a grammar"), ("grammar", "root ::= "), ("min_tokens", -1), ("n", 0),
                  ("logit_bias", {"x": 1}), ("logit_bias", {"99999999": 1}), ("logit_bias", {"2": 150}),
                  ("priority", "bulk"), ("timeout", -1.0), ("top_k", -1), ("logprobs", 21)]


def _sampling_fields():
    """Valid values of every sampling and scheduling field, each present or not."""
    return st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(1, 12),
        "temperature": st.sampled_from([0.0, 0.7, 1.5]),
        "top_k": st.integers(0, 50), "top_p": st.floats(0.05, 1), "min_p": st.floats(0, 0.5),
        "repeat_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "seed": st.integers(-1, 2 ** 31),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
        "grammar": st.sampled_from(GRAMMARS),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 20),
        "logit_bias": st.dictionaries(st.sampled_from([str(EOS_ID), "97", "98", "0"]),
                                      st.floats(-100, 100), max_size=3),
        "n": st.integers(1, 3),
        "priority": st.sampled_from(["interactive", "batch"]),
        "timeout": st.sampled_from([0.001, 5.0, 60.0]),
    })


def _with_one_invalid(bodies):
    corruption = st.one_of(st.just({}), st.sampled_from(INVALID_FIELDS).map(lambda item: dict([item])))
    return st.tuples(bodies, corruption).map(lambda parts: {**parts[0], **parts[1]})


def native_bodies():
    reasoning = st.fixed_dictionaries({}, optional={
        "reasoning_budget": st.integers(0, 4), "reasoning_tags": st.just(["<t>", "</t>"]),
        "logprobs": st.integers(0, 20)})
    return _with_one_invalid(st.tuples(_sampling_fields(), reasoning, st.text(max_size=24)).map(
        lambda parts: {**parts[0], **parts[1], "prompt": parts[2]}))


def http_bodies():
    chat_extra = st.fixed_dictionaries({}, optional={
        "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"},
                                            {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}]),
        "tools": st.just([TOOL]),
        "tool_choice": st.sampled_from(["auto", "none", "required",
                                        {"type": "function", "function": {"name": "ping"}}]),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
        "reasoning_budget": st.integers(0, 4)})
    return st.tuples(st.booleans(), _with_one_invalid(_sampling_fields()), chat_extra, st.text(max_size=24))


@pytest.fixture(scope="module")
def daemon(tiny_tools_model_path):
    yield from serve_module(HttpDaemon(tiny_tools_model_path, "--parallel", "4"))


@pytest.fixture(scope="module")
def watch(daemon):
    """The worker's pid and a long stream of a bystander, checked once every example ran."""
    pid = daemon.new_decode_worker_pid()
    bystander = Bystander(daemon)
    yield pid
    assert bystander.finished(timeout_s=300) == "length", worker_log(daemon)
    assert daemon.new_decode_worker_pid() == pid, worker_log(daemon)


def worker_log(daemon) -> str:
    """The tail of the daemon's log (where a dead worker's traceback is), for an assertion's message."""
    return daemon.log()[-6000:]


PROPERTY_SETTINGS = settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(body=native_bodies())
def test_any_native_request_succeeds_or_is_refused(daemon, watch, body):
    with daemon.client() as client:
        try:
            client.generate(**body)
        except CbatchError as err:
            assert err.code in REQUEST_CODES, (err, worker_log(daemon))
    assert daemon.new_decode_worker_pid() == watch, worker_log(daemon)


@PROPERTY_SETTINGS
@given(drawn=http_bodies())
def test_any_http_request_succeeds_or_is_refused(daemon, watch, drawn):
    is_chat, sampling, chat_extra, text = drawn
    if is_chat:
        path, body = "/v1/chat/completions", {**sampling, **chat_extra, "messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/completions", {**sampling, "prompt": text}
    answer = httpx.post(daemon.base_url + path, json=body, timeout=120)  # no model: the served one
    if answer.status_code != 200:
        assert 400 <= answer.status_code < 500, answer.text
        assert answer.json()["error"]["code"] in REQUEST_CODES, (answer.text, worker_log(daemon))
    assert daemon.new_decode_worker_pid() == watch, worker_log(daemon)
