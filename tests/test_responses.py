"""POST /v1/responses through the official openai package against a real daemon on the
chat model (SmolLM2), told to split <think>...</think>: text and item input, instructions,
streamed events in OpenAI's order, a tool-calling loop, reasoning items and their budget,
max_output_tokens cutting an answer, and bad input. Every object is also validated
strictly against the package's types (the client itself parses leniently)."""

import json
import re
import subprocess
import sys

import openai
import pytest
from conftest import REPO
from daemonkit import serve_module
from httpkit import HttpDaemon
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_reasoning_http import THINKING, never_closing

from cbatch.model import chat_model_path

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather forecast for a city.",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 24}}}}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def daemon():
    yield from serve_module(HttpDaemon(chat_model_path(), "--parallel", "2", "--alias", "m",
                                       "--reasoning-tags", "<think>", "</think>"))


def checked(response) -> Response:
    return Response.model_validate(response.to_dict())


def streamed(api, **request) -> list:
    return [EVENTS.validate_python(event.to_dict()) for event in api.responses.create(stream=True, **request)]


def test_text_input_whole_and_streamed(api):
    request = {"model": "m", "input": "Name a colour.", "instructions": "Answer in one word.",
               "temperature": 0, "max_output_tokens": 24}
    response = checked(api.responses.create(**request))
    assert response.status in ("completed", "incomplete") and response.output_text
    assert [item.type for item in response.output] == ["message"]
    usage = response.usage
    assert usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    events = streamed(api, **request)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    last = "response.completed" if response.status == "completed" else "response.incomplete"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].response.output_text == response.output_text


def test_input_items_and_a_cut_answer(api):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Count to ten."}]},
             {"type": "message", "role": "assistant", "content": "One, two,"},
             {"role": "user", "content": "Go on, slowly."}]
    response = checked(api.responses.create(model="m", input=items, temperature=0, max_output_tokens=3))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


def test_a_tool_calling_loop(api):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = checked(api.responses.create(model="m", input=ask, tools=[WEATHER], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_output_tokens=64))
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    events = streamed(api, model="m", input=ask, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                      temperature=0, max_output_tokens=64)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == json.loads(call.arguments)
    assert "response.function_call_arguments.delta" in [e.type for e in events]
    follow_up = ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                        "arguments": call.arguments},
                       {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}]
    final = checked(api.responses.create(model="m", input=follow_up, tools=[WEATHER], temperature=0,
                                         max_output_tokens=48))
    assert final.output[-1].type == "message" and final.output_text


def test_a_forced_call_cut_by_max_output_tokens_is_a_call_of_an_incomplete_response(api):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = checked(api.responses.create(model="m", input=ask, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_output_tokens=22))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [call] = response.output  # no message item: the cut answer is a call
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments.startswith("{")


def test_structured_output_through_text_format(api):
    schema = {"type": "object", "additionalProperties": False, "required": ["colour"],
              "properties": {"colour": {"type": "string", "maxLength": 12}}}
    response = checked(api.responses.create(model="m", input="Name a colour.", temperature=0, max_output_tokens=48,
                                            text={"format": {"type": "json_schema", "name": "c", "schema": schema}}))
    assert isinstance(json.loads(response.output_text)["colour"], str)
    assert response.text.format.type == "json_schema"


def thinking(**extra) -> dict:
    return {"model": "m", "input": "Name a colour.", "instructions": "You are a helpful assistant.",
            "temperature": 0, "max_output_tokens": 40,
            "extra_body": {"grammar": THINKING, "logit_bias": never_closing()}, **extra}


def test_reasoning_items_and_their_budget(api):
    response = checked(api.responses.create(**thinking(reasoning={"effort": "minimal"})))
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text and response.output_text
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    free = checked(api.responses.create(**thinking()))
    assert [item.type for item in free.output] == ["reasoning"] and free.status == "incomplete"
    assert free.output[0].content[0].text.startswith(reasoning.content[0].text)
    events = streamed(api, **thinking(reasoning={"effort": "minimal"}))
    kinds = [kind for i, kind in enumerate(e.type for e in events) if i == 0 or events[i - 1].type != kind]
    item_events = ["response.output_item.added", "response.content_part.added", "{}.delta", "{}.done",
                   "response.content_part.done", "response.output_item.done"]
    # the answer ends where the grammar allows the model's end of generation, or at max_output_tokens
    assert kinds[:-1] == ["response.created", "response.in_progress",
                          *(k.format("response.reasoning_text") for k in item_events),
                          *(k.format("response.output_text") for k in item_events)]
    assert kinds[-1] == {"completed": "response.completed", "incomplete": "response.incomplete"}[response.status]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text


@pytest.mark.parametrize("request_fields, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "text": "json"}, "text"),
    ({"input": "hi", "reasoning": {"effort": "enormous"}}, "reasoning_effort"),
])
def test_bad_input_is_a_400_naming_the_field(api, request_fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        api.responses.create(model="m", **request_fields)
    assert caught.value.body["param"] == param


DOCS_EXAMPLE = re.compile(r"<!-- readme-test: skip: run by tests/test_responses.py[^>]*-->\n```(\w*)\n(.*?)```", re.S)


def test_the_docs_example_runs_as_printed(daemon):
    """docs/http.md's Responses example, with this test's port for 8000 (its daemon is the
    one started here, as the docs' command starts it)."""
    (_, command), (_, code) = DOCS_EXAMPLE.findall((REPO / "docs" / "http.md").read_text())
    assert "cbatch.model smollm2" in command and '--reasoning-tags "<think>" "</think>"' in command
    ready_wait = command.splitlines()[1].replace("8000", str(daemon.port))  # as pasted, before the script
    subprocess.run(["bash", "-c", ready_wait], check=True, timeout=600)
    out = subprocess.run([sys.executable, "-c", code.replace("8000", str(daemon.port))], capture_output=True,
                         text=True, timeout=600, check=True).stdout
    call, answer, items = out.strip().split("\n")
    kind, name, arguments = call.split(" ", 2)
    assert (kind, name) == ("function_call", "get_weather") and isinstance(json.loads(arguments)["city"], str)
    assert answer.strip() and items == "['reasoning', 'message']"
