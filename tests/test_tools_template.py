"""Tool calls through the model's own chat template, against a real daemon on the tiny
model with a template that knows tools (scripts/chatml_tools.jinja, Hermes-style
<tool_call> tags): over HTTP with the openai package (forced calls, whole and streamed;
a loop whose tool result the template renders), with the ZeroMQ Client and AsyncClient,
and in batch files (native and OpenAI). The tiny model's answers are random: only a
grammar makes them calls, so every call here is forced."""

import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO
from daemonkit import SCRIPTS_DIR, RawPeer, serve_module
from httpkit import HttpDaemon

from cbatch import AsyncClient
from cbatch.protocol import MsgType
from cbatch.tools.formats import Tagged
from cbatch.tools.messages import template_messages
from cbatch.workers.engine.chat_template import ChatTemplate

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
        "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12}}}}}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
GREEDY = {"temperature": 0, "max_tokens": 200}


@pytest.fixture(scope="module")
def daemon(tiny_tools_model_path):
    yield from serve_module(HttpDaemon(tiny_tools_model_path, "--parallel", "4", "--ctx-size", "8192"))


def model(api) -> str:
    return api.models.list().data[0].id


def assert_weather(call: dict) -> dict:
    """An OpenAI tool call of get_weather whose arguments match its schema."""
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city", "days"}, arguments
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 12
    assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 7
    return arguments


def test_the_handshake_names_the_call_format_the_template_teaches_and_not_the_template(daemon):
    with daemon.client() as client:
        info, call_format = client.info, client.tool_format
    assert info["tool_format"] == {"name": "tagged", "arguments_key": "arguments"}
    assert "chat_template" not in info and isinstance(call_format, Tagged)


def test_the_worker_renders_tools_and_tool_turns_sent_as_data_and_refuses_them_shaped_wrong(daemon):
    """A raw caller's chat with an earlier call, its result and the tools: the decode worker
    renders them with the template (the usage counts the template's prompt); a call's
    arguments that are not JSON and a stray field are refused by name, and a bystander's
    request beside them completes."""
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1", "name": "get_weather"}]
    template = ChatTemplate((REPO / "scripts" / "chatml_tools.jinja").read_text(), "<s>", "</s>", adds_bos=True)
    prompt = template.render(history, [WEATHER])
    assert "<tool_response>\nSunny\n</tool_response>" in prompt and '"city": "Oslo"' in prompt
    def bystander():
        with daemon.client() as client:
            return client.generate(prompt="hello", max_tokens=4, temperature=0)

    with RawPeer(daemon.endpoint) as peer, ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(bystander)
        body = {"messages": history, "offered_tools": [WEATHER], "max_tokens": 2}
        peer.send(MsgType.SUBMIT, {"request_id": 1, "body": body})
        _, finished = peer.recv_until(MsgType.FINISHED, timeout_s=60)
        nan_call = {"function": {"name": "f", "arguments": float("nan")}}
        bad_call = [*history[:1], {**history[1], "tool_calls": [nan_call]}]
        for request_id, messages in ((2, bad_call), (3, [{**ASK[0], "tool_call_id": "x"}])):
            peer.send(MsgType.SUBMIT, {"request_id": request_id, "body": {"messages": messages}})
            _, error = peer.recv_until(MsgType.ERROR)
            assert error["code"] == "invalid_request" and error["request_id"] == request_id, error
            assert ("arguments is not JSON" if request_id == 2 else "takes only") in error["message"]
        assert waiting.result(timeout=120).finish_reason == "length"
    assert finished["usage"]["prompt_tokens"] == len(prompt.encode()) + 1


def test_required_is_one_schema_valid_call_in_the_templates_format(api):
    reply = api.chat.completions.create(model=model(api), messages=ASK, tools=[TIME, WEATHER], tool_choice="required",
                                        parallel_tool_calls=False, **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    assert json.loads(call.function.arguments).keys() >= {"city"}


def test_a_named_function_streamed_is_one_tool_calls_delta(api):
    chunks = list(api.chat.completions.create(model=model(api), messages=ASK, tools=[TIME, WEATHER], tool_choice=NAMED,
                                              stream=True, **GREEDY))
    calls = [call.model_dump() for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert_weather(calls[0])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


def test_a_tool_loop_renders_the_result_with_the_template_and_answers(api, tiny_tools_model_path):
    """Call, result, answer; the answer's prompt is the template's rendering of the whole
    conversation, BOS once (the tiny model's byte vocabulary: a token per byte, plus BOS)."""
    reply = api.chat.completions.create(model=model(api), messages=ASK, tools=[WEATHER], tool_choice=NAMED, **GREEDY)
    call = reply.choices[0].message.tool_calls[0]
    assert_weather(call.model_dump())
    history = [*ASK, reply.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 °C"}]
    answer = api.chat.completions.create(model=model(api), messages=history, tools=[WEATHER], temperature=0,
                                         max_tokens=8)
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None
    template = ChatTemplate((REPO / "scripts" / "chatml_tools.jinja").read_text(), "<s>", "</s>", adds_bos=True)
    prompt = template.render(template_messages(history), [WEATHER])
    assert "<tool_response>\nSunny, 21 °C\n</tool_response>" in prompt and '"name": "get_weather"' in prompt
    assert answer.usage.prompt_tokens == len(prompt.encode()) + 1


def test_the_zeromq_client_reads_calls_whole_and_streamed(daemon):
    with daemon.client() as client:
        result = client.generate(messages=ASK, tools=[WEATHER], tool_choice=NAMED, **GREEDY)
        chunks = list(client.stream(messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                    **GREEDY))
    assert result.finish_reason == "tool_calls" and result.text == ""  # the call is not text
    (call,) = result.tool_calls
    assert_weather(call)
    assert chunks[-1].finish_reason == "tool_calls" and len(chunks[-1].tool_calls) == 1
    assert_weather(chunks[-1].tool_calls[0])
    assert all(c.tool_calls is None and c.text == "" for c in chunks[:-1])


def test_the_async_client_reads_calls_and_sends_a_tool_loop(daemon):
    async def run():
        async with await AsyncClient.connect(daemon.endpoint) as client:
            first = await client.generate(messages=ASK, tools=[WEATHER], tool_choice=NAMED, **GREEDY)
            history = [*ASK, {"role": "assistant", "content": None, "tool_calls": first.tool_calls},
                       {"role": "tool", "tool_call_id": first.tool_calls[0]["id"], "content": "Sunny"}]
            return first, await client.generate(messages=history, tools=[WEATHER], temperature=0, max_tokens=8)

    first, answer = asyncio.run(run())
    assert_weather(first.tool_calls[0])
    assert answer.finish_reason == "length" and answer.text and answer.tool_calls is None


def test_a_named_function_with_a_grammar_is_a_clear_error(daemon):
    from cbatch.errors import CbatchError

    with daemon.client() as client, pytest.raises(CbatchError) as caught:
        client.generate(messages=ASK, tools=[WEATHER], tool_choice=NAMED, grammar='root ::= "x"')
    assert caught.value.code == "invalid_request" and "grammar" in caught.value.message


@pytest.mark.parametrize("function, mentions", [
    ({"name": "f", "parameters": {"type": "object", "properties": {"x": {"maximum": math.nan}}}},
     "tools[0].function.parameters is not JSON"),
    ({"name": "f", "description": ["not", "text"]}, "tools[0].function.description must be a string"),
])
def test_a_tool_the_daemon_could_not_describe_is_refused_under_the_callers_name(daemon, function, mentions):
    """What the worker checks of offered tools is checked first where the caller's `tools`
    are read, so the error names the field the caller sent; a bystander's chat carries on."""
    from cbatch.errors import CbatchError

    with daemon.client() as client:
        for choice in ("auto", "required"):
            with pytest.raises(CbatchError) as caught:
                client.generate(messages=ASK, tools=[{"type": "function", "function": function}],
                                tool_choice=choice, **GREEDY)
            assert caught.value.code == "invalid_request" and mentions in caught.value.message, caught.value.message
        assert client.generate(messages=ASK, tools=[WEATHER], tool_choice=NAMED, **GREEDY).tool_calls


def _submit(daemon, tmp_path, lines: list[dict], *args: str) -> list[dict]:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                    *args], env=daemon.env, check=True, capture_output=True, timeout=120)
    return [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("over", ["zeromq", "http"])
def test_a_native_batch_file_with_tools_writes_the_calls(daemon, tmp_path, over):
    """Over ZeroMQ the submitter sends the tools to the daemon, whose template renders
    them; over --url the lines go with their tools to /v1/chat/completions."""
    url = ("--url", f"{daemon.base_url}/v1") if over == "http" else ()
    out = _submit(daemon, tmp_path, [
        {"id": "call", "messages": ASK, "tools": [WEATHER], "tool_choice": NAMED, **GREEDY},
        {"id": "two", "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
         "n": 2, "seed": 1, "max_tokens": 200},
        {"id": "plain", "messages": ASK, "max_tokens": 4},
    ], *url)
    assert [line["id"] for line in out] == ["call", "two", "plain"]
    assert out[0]["finish_reason"] == "tool_calls" and out[0]["text"] == ""
    assert_weather(out[0]["tool_calls"][0])
    for choice in out[1]["choices"]:
        assert choice["finish_reason"] == "tool_calls" and len(choice["tool_calls"]) == 1
    assert out[2]["finish_reason"] == "length" and "tool_calls" not in out[2]


@pytest.mark.parametrize("over", ["zeromq", "http"])
def test_an_openai_batch_file_with_tools_answers_with_tool_calls(daemon, tmp_path, over):
    """Over ZeroMQ the submitter sends the line's tools to the daemon; over --url to the
    HTTP server, which sends them on: the same prompt either way."""
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": NAMED, **GREEDY}
    over_http = daemon.openai().chat.completions.create(model=daemon.openai().models.list().data[0].id, **body)
    url = ("--url", f"{daemon.base_url}/v1") if over == "http" else ()
    (line,) = _submit(daemon, tmp_path, [{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                                          "body": body}], *url)
    response = line["response"]["body"]
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert_weather(choice["message"]["tool_calls"][0])
    assert response["usage"]["prompt_tokens"] == over_http.usage.prompt_tokens


DOCS_EXAMPLE = re.compile(r"<!-- readme-test: skip: run by tests/test_tools_template.py[^>]*-->\n```(\w*)\n(.*?)```",
                          re.S)


def test_the_docs_template_example_runs_as_printed(daemon, tiny_tools_model_path, tmp_path):
    """docs/http.md's example: its model command writes this test's model, and its script
    runs against this test's daemon (its port for 8001)."""
    (_, commands), (_, code) = DOCS_EXAMPLE.findall((REPO / "docs" / "http.md").read_text())
    make_model = commands.splitlines()[0].replace("/tmp/tiny-tools.gguf", str(tmp_path / "m.gguf"))
    subprocess.run(make_model.replace(".venv/bin/python", sys.executable), shell=True, cwd=REPO, check=True,
                   capture_output=True)
    assert (tmp_path / "m.gguf").read_bytes() == Path(tiny_tools_model_path).read_bytes()
    ready_wait = commands.splitlines()[2].replace("8001", str(daemon.port))  # as pasted, before the script
    subprocess.run(["bash", "-c", ready_wait], check=True, timeout=600)
    out = subprocess.run([sys.executable, "-c", code.replace("8001", str(daemon.port))], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    call, answer = out.splitlines()
    reason, name, arguments = call.split(" ", 2)
    assert (reason, name) == ("tool_calls", "get_weather") and set(json.loads(arguments)) == {"city"}
    prompt_tokens, reason = answer.split()
    assert int(prompt_tokens) > 200 and reason == "length"


def test_a_restarted_worker_welcomes_every_client_again_with_the_call_format(start_daemon, tiny_tools_model_path):
    """A client welcomed while the model loads gets no call format: every client is
    welcomed again when the worker is ready (here after a restart), with it."""
    restarting = start_daemon(tiny_tools_model_path)
    with RawPeer(restarting.endpoint) as peer:
        assert peer.welcome["tool_format"]["name"] == "tagged"
        os.kill(restarting.health["worker_pid"], signal.SIGKILL)
        _, welcome = peer.recv_until(MsgType.WELCOME, timeout_s=60)
    assert welcome["tool_format"] == peer.welcome["tool_format"]
