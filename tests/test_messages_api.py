"""POST /v1/messages through the official anthropic package, against a real daemon on the
chat model (SmolLM2): text answers whole and streamed with the SDK's helpers, usage with
the prefix cache's tokens, what Claude Code sends (system blocks, a system message in the
middle, cache_control, blocks of unknown types), a tool round trip with tool_result, the
errors as the SDK's exception classes, and keys sent as x-api-key."""

import json
from pathlib import Path

import anthropic
import httpx
import pytest
from daemonkit import serve_module
from httpkit import HttpDaemon

from cbatch.model import chat_model_path

WEATHER = {"name": "get_weather", "description": "The weather forecast for a city.",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 24}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
KEY = "a-key-for-the-tests"
GREEDY = {"temperature": 0}  # a cbatch field: the SDK names no temperature


@pytest.fixture(scope="module")
def daemon():
    yield from serve_module(HttpDaemon(chat_model_path(), "--parallel", "2", "--alias", "m", "--api-key", KEY))


@pytest.fixture
def claude(daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.base_url, api_key=KEY, max_retries=0)


def test_a_text_answer_whole_and_streamed_with_its_usage(claude):
    request = {"model": "m", "max_tokens": 12, "extra_body": GREEDY,
               "messages": [{"role": "user", "content": "Hello!"}]}
    message = claude.messages.create(**request)
    assert message.type == "message" and message.role == "assistant" and message.model == "m"
    [block] = message.content
    assert block.type == "text" and block.text and message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens <= 12 and message.usage.input_tokens + message.usage.cache_read_input_tokens > 0
    with claude.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == block.text and final.content[0].text == block.text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens
    again = claude.messages.create(**request)
    assert again.usage.cache_read_input_tokens > 0  # the same prompt, from the prefix cache


def test_a_stop_sequence_is_named_in_the_stop_reason(daemon, claude):
    request = {"model": "m", "max_tokens": 16, "extra_body": GREEDY, "messages": [{"role": "user", "content": "Hi"}]}
    text = claude.messages.create(**request).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3, text
    message = claude.messages.create(**request, stop_sequences=["never written", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]
    with claude.messages.stream(**request, stop_sequences=[stop]) as stream:
        assert stream.get_final_message().stop_sequence == stop
    with daemon.client() as client:  # the native client names it on its last chunk
        chunks = list(client.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=16, temperature=0,
                                    stop=[stop]))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_string == stop


def test_what_claude_code_sends_is_taken(claude):
    """System blocks with cache_control and a billing line, a system message mid-conversation,
    a thinking block of an earlier turn and a block of a type this server does not know."""
    message = claude.messages.create(
        model="m", max_tokens=8, extra_body=GREEDY,
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=abc;"},
                {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "...", "signature": "s"},
                                                    {"type": "text", "text": "Hello."}]},
                  {"role": "system", "content": "Answer in English."},
                  {"role": "user", "content": [{"type": "text", "text": "Bye"}, {"type": "mystery_block"}]}],
        metadata={"user_id": "someone"})
    assert message.content[0].type == "text" and message.usage.output_tokens >= 1


def test_the_billing_line_does_not_defeat_the_prefix_cache(claude):
    """Claude Code's billing line changes on every request; the next turn is served from the cache all the same."""
    long_system = "You are a careful assistant. " * 40

    def turn(cch: str):
        return claude.messages.create(model="m", max_tokens=2, extra_body=GREEDY, messages=ASK, system=[
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.37; cch={cch};"},
            {"type": "text", "text": long_system}]).usage

    turn("aaaaa")
    again = turn("bbbbb")
    assert again.cache_read_input_tokens > 200 and again.input_tokens < 32


RECORDED = Path(__file__).parent / "recorded" / "claude_code_request.json"


def test_a_recorded_claude_code_request_streams_anthropics_event_sequence(daemon):
    """Claude Code's shape, as it sends it (billing line, cache_control everywhere, a thinking
    block of an earlier turn, a tool round, a system message mid-conversation, a block of an
    unknown type), replayed raw: the events come in Anthropic's order, each named by its type."""
    with httpx.stream("POST", f"{daemon.base_url}/v1/messages", json=json.loads(RECORDED.read_text()), timeout=120,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = []
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    assert all(name == event["type"] for name, event in events)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    usage = events[-2][1]["usage"]  # the whole prompt at the start, what the cache served at the end
    assert events[0][1]["message"]["usage"]["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    blocks = names[2:-2]
    assert blocks and blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks) <= {"content_block_start", "content_block_delta", "content_block_stop"}
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert events[-2][1]["usage"]["output_tokens"] >= 1


def test_a_tool_round_trip(claude):
    first = claude.messages.create(model="m", max_tokens=64, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str) and call.id.startswith("toolu_")
    with claude.messages.stream(model="m", max_tokens=64, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == call.input
    answer = claude.messages.create(model="m", max_tokens=24, extra_body=GREEDY, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "Sunny, 21 C."}]}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"


def test_structured_output_through_output_config(claude):
    schema = {"type": "object", "additionalProperties": False, "required": ["colour"],
              "properties": {"colour": {"enum": ["red", "blue"]}}}
    message = claude.messages.create(model="m", max_tokens=32, extra_body=GREEDY, messages=ASK,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn" and json.loads(message.content[0].text)["colour"] in ("red", "blue")


def test_count_tokens_counts_the_prompt_as_the_model_sees_it(daemon, claude):
    """The count of a request is its prompt tokens when it runs, tools and system included."""
    request = {"model": "m", "system": "You are terse.", "messages": ASK, "tools": [WEATHER]}
    counted = claude.messages.count_tokens(**request).input_tokens
    ran = claude.messages.create(max_tokens=1, extra_body=GREEDY, **request).usage
    assert counted == ran.input_tokens + ran.cache_read_input_tokens > 20
    assert claude.messages.count_tokens(model="m", messages=ASK).input_tokens < counted  # no tools, no system
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model="m", messages="not a list")


def test_errors_are_the_sdks_exceptions_in_anthropics_shape(daemon, claude):
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model="m", max_tokens=0, messages=ASK)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-opus-4", max_tokens=4, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=daemon.base_url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=ASK)
    assert refused.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(f"{daemon.base_url}/v1/messages", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                        json={"model": "m", "max_tokens": 2, "messages": ASK})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="m", max_tokens=4, messages=[{"role": "robot", "content": "hi"}])
    empty = claude.messages.create(model="m", max_tokens=2, messages=[])  # taken, as llama-server takes it
    assert empty.type == "message" and empty.content[0].type == "text"
