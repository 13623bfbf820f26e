"""Tool calling on /v1/chat/completions through the official openai package, against a real
daemon with --http on the chat model (SmolLM2): forced calls always match their
function's schema, streamed and not; docs/http.md's loop (call, tool result, streamed
answer) as printed; bad input."""

import json
import re
import subprocess
import sys

import openai
import pytest
from conftest import REPO
from daemonkit import serve_module
from httpkit import HttpDaemon

from cbatch.model import chat_model_path

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
                   "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 24}}}}}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
GREEDY = {"temperature": 0, "max_tokens": 96}


@pytest.fixture(scope="module")
def daemon():
    yield from serve_module(HttpDaemon(chat_model_path(), "--parallel", "2", "--ctx-size", "4096"))


def model(api) -> str:
    return api.models.list().data[0].id


def assert_weather_arguments(arguments: str) -> dict:
    """Valid against WEATHER's schema: exactly its properties, each of its type and range."""
    parsed = json.loads(arguments)
    assert set(parsed) == {"city", "unit", "days"}, parsed
    assert isinstance(parsed["city"], str) and len(parsed["city"]) <= 24
    assert parsed["unit"] in ("celsius", "fahrenheit")
    assert isinstance(parsed["days"], int) and 1 <= parsed["days"] <= 7
    return parsed


def test_a_named_function_is_called_once_with_schema_valid_arguments_even_when_nothing_asks_for_it(api):
    reply = api.chat.completions.create(model=model(api), messages=[{"role": "user", "content": "Hello!"}],
                                        tools=[TIME, WEATHER], **GREEDY,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert_weather_arguments(call.function.arguments)


def test_required_streamed_gives_tool_call_deltas_and_one_call_without_parallel_calls(api):
    chunks = list(api.chat.completions.create(model=model(api), messages=ASK, tools=[WEATHER], tool_choice="required",
                                              parallel_tool_calls=False, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert_weather_arguments(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_a_forced_call_cut_by_max_tokens_is_still_a_call_and_says_length(daemon, api):
    """SmolLM2 with parallel calls (the default) calls again and again until max_tokens: the
    answer is the calls as far as written, never content (finish_reason "length", as OpenAI
    answers a cut call), the whole ones with their arguments, the cut one's as written, the
    same streamed and not, after a first chunk that promised no content."""
    ask = {"model": model(api), "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
           "temperature": 0, "max_tokens": 60}
    choice = api.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(call.function.name == "get_weather" for call in calls)
    for call in calls[:-1]:
        assert_weather_arguments(call.function.arguments)
    last = calls[-1].function.arguments  # cut as far as written (greedy: the same place every time)
    assert last.startswith('{"city": "') and not last.endswith("}"), calls
    chunks = [c.choices[0] for c in api.chat.completions.create(**ask, stream=True) if c.choices]
    assert chunks[-1].finish_reason == "length" and not any(c.delta.content for c in chunks)
    streamed = [call for c in chunks for call in c.delta.tool_calls or []]
    assert [(call.function.name, call.function.arguments) for call in streamed] == \
        [(call.function.name, call.function.arguments) for call in calls]
    with daemon.client() as client:  # the native client says the same
        result = client.generate(messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60)
    assert result.finish_reason == "length" and result.tool_calls[-1]["function"]["arguments"] == last


DOCS_EXAMPLE = re.compile(r"<!-- readme-test: skip: run by tests/test_tools.py[^>]*-->\n```(\w*)\n(.*?)```", re.S)


def test_the_docs_tool_loop_runs_as_printed_call_result_and_streamed_answer(daemon):
    """docs/http.md's example, with this test's port for 8000 (its daemon is the one
    started here, on the model the docs' command names)."""
    (_, command), (_, code) = DOCS_EXAMPLE.findall((REPO / "docs" / "http.md").read_text())
    assert "cbatch.model smollm2" in command
    ready_wait = command.splitlines()[1].replace("8000", str(daemon.port))  # as pasted, before the script
    subprocess.run(["bash", "-c", ready_wait], check=True, timeout=600)
    out = subprocess.run([sys.executable, "-c", code.replace("8000", str(daemon.port))], capture_output=True,
                         text=True, timeout=600, check=True).stdout
    call, answer = out.split("\n", 1)
    name, arguments = call.split(" ", 1)
    assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str)
    assert answer.strip() and "tool_calls" not in answer, answer  # an answer in words, not the call again


def test_the_history_tells_the_model_its_calls_and_their_results_in_words():
    from cbatch.tools.messages import cbatch_messages

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    result = {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Sunny"}]}
    messages = cbatch_messages([*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}, result])
    assert messages[1:] == [{"role": "assistant", "content": 'Called get_weather with {"city": "Paris"}.'},
                            {"role": "user", "content": "get_weather returned: Sunny"}]


def test_auto_answers_in_text_when_the_model_does_not_call(api):
    reply = api.chat.completions.create(model=model(api), messages=[{"role": "user", "content": "Say hello."}],
                                        tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=12)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.content
    assert reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "?"}]}, "messages"),
])
def test_bad_tool_input_is_a_400_naming_the_field(daemon, api, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=model(api), **{"messages": ASK, "max_tokens": 4, **extra})
    assert caught.value.body["param"] == param and caught.value.body["code"] == "invalid_request"


def test_an_openai_batch_line_with_tools_sends_the_grammar_and_answers_with_tool_calls():
    """Batch files share the HTTP API's mapping: a forced call is constrained and written
    out as tool_calls (the model's answer is played here: a daemon run is the HTTP tests')."""
    from cbatch.batch.openai_batch import OpenAILine
    from cbatch.client.streams import Chunk

    body = {"model": "m", "messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    line = OpenAILine(1, {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}, ["m"])
    (request,) = line.bodies
    assert list(request["tool_call"]["functions"]) == ["get_weather"]
    assert "get_weather" in request["messages"][0]["content"]
    answer = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}]}'
    line.add(0, Chunk(0, answer, [1], "stop", {"prompt_tokens": 9, "completion_tokens": 1}))
    choice = line.result["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
