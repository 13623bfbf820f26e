"""The HTTP server's event loop with hostile schemas, and two OpenAI details, against a
real daemon with --http on the tiny model (its chat template knows tools): a `maxLength:
1e9` (in a response_format and in a tool's parameters), a 10,000-way enum, recursion with
no base case, 200-deep nesting, a 1 MB schema and a feature llguidance lacks are each
answered or refused quickly, the HTTP process does not grow, and a concurrent stream keeps
its pace; bounds constrain the answer (integer bounds too, on /v1/responses as well); a
streamed forced call opens with null content; a /v1/responses request its timeout ends is incomplete
(and a cancelled answer, without a daemon, cancelled)."""

import json
import threading
import time

import httpx
import pytest
from daemonkit import serve_module, wait_until
from httpkit import HttpDaemon
from openai.types.responses import Response

from cbatch.constraints import MAX_SCHEMA_DEPTH

MODEL_ID = "tiny-tools.gguf"
ASK = [{"role": "user", "content": "hi"}]
ENDLESS = {"max_tokens": 100_000, "ignore_eos": True}
HUGE = 1_000_000_000
# The old GBNF converter took 16 s on maxLength 1e8 in the HTTP process, and the stream
# stopped as long; half of that leaves a busy machine room and still tells the two apart.
ANSWERED_WITHIN_S = 8.0
MAX_RSS_GROWTH_BYTES = 100 << 20  # the old converter's grew by about 500 MB
MAX_STREAM_GAP_S = ANSWERED_WITHIN_S / 2
STREAM_START_TIMEOUT_S = 120.0
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 8}}}}}


@pytest.fixture(scope="module")
def daemon(tiny_tools_model_path):
    yield from serve_module(HttpDaemon(tiny_tools_model_path, "--parallel", "2"))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


class TimedStream:
    """A streamed completion read in a thread, each event's arrival time kept."""

    def __init__(self, base_url: str):
        self.arrivals_s: list[float] = []
        self.is_done = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(base_url,))
        self._thread.start()

    def _read(self, base_url: str) -> None:
        body = {"model": MODEL_ID, "prompt": "x", "stream": True, **ENDLESS, "timeout": 120}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("data: "):
                    self.arrivals_s.append(time.monotonic())
                    self.is_done = line == "data: [DONE]"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def max_gap_s(self, since_s: float, until_s: float) -> float:
        """The longest time without an event in [since_s, until_s]."""
        times = [since_s, *(t for t in self.arrivals_s if since_s < t < until_s), until_s]
        return max(later - earlier for earlier, later in zip(times, times[1:]))


def chat(daemon, **body) -> httpx.Response:
    return httpx.post(f"{daemon.base_url}/v1/chat/completions", json={"model": MODEL_ID, "messages": ASK, **body},
                      timeout=120)


def json_schema(schema: dict, strict: bool = False) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                       **({"strict": True} if strict else {})}}}


def test_bounded_schemas_constrain_the_answer(daemon):
    schema = {"type": "object", "additionalProperties": False, "required": ["word", "numbers"], "properties": {
        "word": {"type": "string", "minLength": 2, "maxLength": 5},
        "numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}}}
    for seed in range(3):
        reply = chat(daemon, temperature=1.0, seed=seed, max_tokens=200, **json_schema(schema))
        assert reply.status_code == 200, reply.text
        answer = json.loads(reply.json()["choices"][0]["message"]["content"])
        assert 2 <= len(answer["word"]) <= 5 and 1 <= len(answer["numbers"]) <= 3, answer


INTEGER_BOUNDS = {"age": (None, 120), "year": (1900, 2100), "big": (10 ** 12, None), "cold": (-60, -10)}


def test_integer_bounds_constrain_the_answer_on_both_endpoints(daemon):
    """One-sided, wide, negative: the tiny model writes any digits it likes where nothing
    bounds them (`"maximum": 120` once came back as 1000000000000000)."""
    properties = {name: {"type": "integer", **({"minimum": low} if low is not None else {}),
                         **({"maximum": high} if high is not None else {})}
                  for name, (low, high) in INTEGER_BOUNDS.items()}
    schema = {"type": "object", "additionalProperties": False, "required": list(properties), "properties": properties}
    api = daemon.openai()
    answers = []
    for seed in range(3):
        reply = chat(daemon, temperature=1.0, seed=seed, max_tokens=300, **json_schema(schema))
        assert reply.status_code == 200, reply.text
        answers.append(json.loads(reply.json()["choices"][0]["message"]["content"]))
        response = api.responses.create(model=MODEL_ID, input="hi", temperature=1.0, max_output_tokens=300,
                                        extra_body={"seed": seed},
                                        text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
        answers.append(json.loads(response.output_text))
    for answer in answers:
        assert all((low is None or answer[name] >= low) and (high is None or answer[name] <= high)
                   for name, (low, high) in INTEGER_BOUNDS.items()), answer


def hostile_bodies() -> list[tuple[dict, str | None]]:
    """(body, None when it may be answered, else what its 400 names)."""
    deep = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    endless = {"$defs": {"a": {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/$defs/a"}}}},
               "$ref": "#/$defs/a"}  # recursion with no base case
    huge_tool = {**WEATHER["function"], "parameters": {"type": "object", "properties": {
        "notes": {"type": "string", "maxLength": HUGE}}}}
    return [
        (json_schema({"type": "object", "properties": {"text": {"type": "string", "maxLength": HUGE}}}), None),
        ({"tools": [{"type": "function", "function": huge_tool}], "tool_choice": "required"}, None),
        (json_schema({"enum": [f"value {i}" for i in range(10_000)]}), None),
        (json_schema(endless), None),
        (json_schema(deep), f"more than {MAX_SCHEMA_DEPTH} deep"),
        (json_schema({"type": "object", "description": "x" * (1 << 20)}), "longer than"),
        (json_schema({"type": "array", "uniqueItems": True}), None),  # not enforced, as no strict was asked
        (json_schema({"type": "array", "uniqueItems": True}, strict=True), "uniqueItems"),
    ]


def test_hostile_schemas_are_answered_or_refused_quickly_while_a_stream_keeps_its_pace(daemon):
    """A schema is compiled by the decode worker's preparer within llguidance's limits: the
    HTTP process converts nothing (it does not grow), the stream beside it keeps its pace,
    and the worker lives on."""
    http_pid = daemon.http_pids()[-1]
    with daemon.client() as client:
        worker_pid = client.health()["worker_pid"]
    assert chat(daemon, max_tokens=4, **json_schema({"type": "string", "maxLength": 4})).status_code == 200
    rss_before = rss_bytes(http_pid)
    stream = TimedStream(daemon.base_url)
    try:
        wait_until(lambda: len(stream.arrivals_s) >= 5, timeout_s=STREAM_START_TIMEOUT_S)
        window_start_s = time.monotonic()
        for body, refusal in hostile_bodies():
            started = time.monotonic()
            reply = chat(daemon, max_tokens=4, **body)
            assert time.monotonic() - started < ANSWERED_WITHIN_S
            if refusal is None:
                assert reply.status_code == 200, reply.text
            else:
                assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"
                assert refusal in reply.json()["error"]["message"], reply.json()
        window_end_s = time.monotonic()
        assert not stream.is_done, "the stream ended before the requests did: it measured nothing"
        assert stream.max_gap_s(window_start_s, window_end_s) < MAX_STREAM_GAP_S
    finally:
        stream.close()
    assert rss_bytes(http_pid) - rss_before < MAX_RSS_GROWTH_BYTES
    with daemon.client() as client:
        assert client.health()["worker_pid"] == worker_pid


def sse_data(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("tool_choice, first_content", [
    ("required", None), ({"type": "function", "function": {"name": "get_weather"}}, None), ("auto", "")])
def test_a_streamed_forced_call_opens_with_null_content(daemon, tool_choice, first_content):
    call = {"tools": [WEATHER], "tool_choice": tool_choice, "parallel_tool_calls": False, "temperature": 0,
            "max_tokens": 200}  # one call, of a bounded city: its grammar ends well within max_tokens
    body = {"model": MODEL_ID, "messages": ASK, "stream": True, **call}
    with httpx.stream("POST", f"{daemon.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        chunks = sse_data(response)
    first = chunks[0]["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": first_content}
    if first_content is None:  # as the whole answer's message has it
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        whole = chat(daemon, **call).json()
        assert whole["choices"][0]["message"]["content"] is None


# A grammar no answer completes: the answer runs until the request's timeout ends it.
NEVER_ENDING = {"grammar": "root ::= [a-z] root", "timeout": 1.0}


def test_a_responses_request_its_timeout_ends_is_incomplete(daemon):
    api = daemon.openai()
    request = {"model": MODEL_ID, "input": "x", "max_output_tokens": 100_000, "extra_body": NEVER_ENDING}
    response = Response.model_validate(api.responses.create(**request).to_dict())  # OpenAI's values only
    assert response.status == "incomplete" and response.incomplete_details.reason is None
    # (on a loaded machine the deadline may pass before the first token: no item then)
    assert all(item.status == "incomplete" for item in response.output)
    events = list(api.responses.create(stream=True, **request))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_a_cancelled_answer_is_a_cancelled_response():
    """(Cancelled answers reach a caller only when a drain's grace period runs out.)"""
    from cbatch.openai.responses_output import ResponseEvents
    from cbatch.openai.responses_request import parse_responses_request

    events = ResponseEvents(parse_responses_request({"input": "x"}, [MODEL_ID], None), {})
    last = events.push("some text", 2, "cancelled", {"prompt_tokens": 3, "completion_tokens": 2})[-1]
    assert last["type"] == "response.incomplete"
    response = Response.model_validate({**last["response"], "tools": [], "tool_choice": "auto",
                                        "parallel_tool_calls": True})
    assert response.status == "cancelled" and response.incomplete_details is None
    assert response.output[0].status == "incomplete" and response.output_text == "some text"
