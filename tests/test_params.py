"""Request validation: every bad value is rejected with invalid_request and a clear message."""

import json
import math

import pytest

from cbatch.chat_messages import ChatCall, ChatMessage, ToolSpec
from cbatch.constraints import MAX_SCHEMA_DEPTH
from cbatch.errors import INVALID_REQUEST, CbatchError
from cbatch.openai.choices import expand_choices
from cbatch.params import MAX_SEED, SamplingParams, parse_params, parse_request


def _nested(depth: int) -> list:
    value = []
    for _ in range(depth):
        value = [value]
    return value


BAD_BODIES = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": math.nan}, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -1}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "repeat_penalty": 0}, "repeat_penalty"),
    ({"prompt": "x", "presence_penalty": math.inf}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
    ({"prompt": "x", "seed": -2}, "seed"),
    ({"prompt": "x", "seed": 2**40}, "seed"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "x", "grammar": 5}, "grammar"),
    ({"prompt": "x", "grammar": "a" * ((1 << 18) + 1)}, "longer than"),
    ({"prompt": "x", "json_schema": "{}"}, "json_schema must be a JSON schema object"),
    ({"prompt": "x", "json_schema": {"enum": [math.nan]}}, "json_schema is not JSON"),
    ({"prompt": "x", "json_schema": {"type": "string"}, "grammar": "root ::= \"a\""}, "not grammar and json_schema"),
    ({"prompt": "x", "json_schema": {"type": "string"}, "tool_call": {"format": "tagged", "functions": {"f": {}}}},
     "not json_schema and tool_call"),
    ({"prompt": "x", "tool_call": {"format": "tagged", "functions": {}}}, "whose functions map each name"),
    ({"prompt": "x", "tool_call": {"format": "xml", "functions": {"f": {}}}}, "tool_call"),
    ({"prompt": "x", "tool_call": {"format": "tagged", "functions": {"f": []}}}, "tool_call.functions.f must be"),
    ({"prompt": "x", "tool_call": {"format": "tagged", "functions": {f"f{i}": {"description": "d" * 30_000}
                                                                     for i in range(10)}}}, "together"),
    ({"prompt": "x", "json_schema": {"type": "string"}, "ignore_eos": True}, "cannot be combined"),
    ({"prompt": "x", b"raw": 1}, "keys must be strings"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "x", "logit_bias": {"\u00b2": 1}}, "logit_bias keys"),  # a digit to str.isdigit, not to int()
    ({"prompt": "x", "grammar": "root ::= \"a\"", "ignore_eos": True}, "cannot be combined"),
    ({"prompt": "x", "temprature": 0.5}, "unknown parameter"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "\ud800"}, "UTF-8"),
    ({"prompt": 42}, "prompt"),
    ({}, "exactly one"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "y"}]}, "role"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": None}]}, "content"),
    ({"messages": ["hi"]}, "messages[0]"),
    # A chat's tools, calls and results as cbatch.tools prepares them for the daemon's template.
    ({"messages": [{"role": "user", "content": "y", "tool_calls": []}]}, "messages[0] takes only"),
    ({"messages": [{"role": ["user"], "content": "y"}]}, "messages[0].role must be one of"),
    ({"messages": [42]}, "messages[0] must be an object"),
    ({"messages": [{"role": "tool", "content": "y"}]}, "messages[0].tool_call_id must be a string"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0] must be"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": math.inf}}}]}]}, "arguments is not JSON"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": _nested(2000)}}]}]}, "arguments is not JSON"),
    ({"prompt": "x", "offered_tools": [{"type": "function", "function": {"name": "f"}}]}, "take 'messages'"),
    ({"messages": [{"role": "user", "content": "y"}], "offered_tools": [{"function": {"name": "f"}}]},
     "offered_tools[0] must be"),
    ({"messages": [{"role": "user", "content": "y"}], "offered_tools": [
        {"type": "function", "function": {"name": "f", "parameters": []}}]}, "offered_tools[0] must be"),
    # Scheduling: each message leads with the field's name as the caller wrote it.
    ({"prompt": "x", "priority": "urgent"}, "priority must be one of ['interactive', 'batch'], got 'urgent'"),
    ({"prompt": "x", "timeout": 0}, "timeout: expected `float` > 0.0, got 0"),
    ({"prompt": "x", "timeout": 8 * 24 * 3600}, "timeout: expected `float` <= 604800"),
    ({"prompt": "x", "timeout": True}, "timeout: expected `float | null`, got `bool`"),
    ({"prompt": "x", "tenant": "two words"},
     "tenant must be 1 to 64 letters, digits, '_', '.' or '-', got 'two words'"),
    ({"prompt": "x", "tenant": "t" * 65}, "tenant must be 1 to 64 letters"),
    ({"prompt": "x", "tenant_weight": 0}, "tenant_weight: expected `float` > 0.0, got 0"),
    ({"prompt": "x", "tenant_weight": math.nan}, "tenant_weight"),
]


@pytest.mark.parametrize("body,mentions", BAD_BODIES)
def test_bad_request_rejected_with_field_named(body, mentions):
    with pytest.raises(CbatchError) as err:
        parse_request(1, body)
    assert err.value.code == INVALID_REQUEST
    assert mentions in err.value.message


def test_good_request_gets_defaults_and_values():
    request = parse_request(9, {"prompt": "hi", "max_tokens": 3, "temperature": 0, "stop": "END", "seed": 5})
    assert request.request_id == 9 and request.prompt == "hi" and request.messages is None
    assert request.params == SamplingParams(max_tokens=3, temperature=0.0, stop=("END",), seed=5)
    assert request.params.is_plain_greedy
    chat = parse_request(10, {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "hi"}]})
    assert chat.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "hi")) and not chat.offered_tools
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    tools = parse_request(11, {"messages": [{"role": "assistant", "content": "", "tool_calls": [call]},
                                            {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "f"}],
                               "offered_tools": [{"type": "function", "function": {"name": "f"}}]})
    assert tools.messages[0].tool_calls == (ChatCall("c1", "f", '{"x":1}'),)
    assert (tools.messages[1].tool_call_id, tools.messages[1].name) == ("c1", "f")
    assert tools.offered_tools == (ToolSpec("f", "", "{}"),)
    assert not chat.params.is_plain_greedy
    batch = parse_request(12, {"prompt": "x", "priority": "batch", "timeout": 2, "tenant": "team-a",
                               "tenant_weight": 3})
    assert (batch.priority, batch.timeout_s, batch.tenant, batch.tenant_weight) == ("batch", 2.0, "team-a", 3.0)
    assert (request.priority, request.timeout_s, request.tenant, request.tenant_weight) == ("interactive", None,
                                                                                          "default", 1.0)


def test_n_expands_into_choices_with_consecutive_seeds():
    assert expand_choices({"prompt": "p"}) == [{"prompt": "p"}]
    assert [b["seed"] for b in expand_choices({"prompt": "p", "n": 3, "seed": 7})] == [7, 8, 9]
    assert all("seed" not in b and "n" not in b for b in expand_choices({"prompt": "p", "n": 2}))
    for bad in ({"n": 0}, {"n": 17}, {"n": "2"}, {"n": 2, "seed": MAX_SEED}):
        with pytest.raises(CbatchError, match="n must|seed must"):
            expand_choices({"prompt": "p", **bad})


def test_a_json_schema_travels_as_compact_json_in_the_callers_key_order():
    schema = {"type": "object", "properties": {"z": {"type": "integer", "minimum": 0}, "a": {"type": "string"}},
              "additionalProperties": True}
    text = parse_params({"json_schema": schema}).json_schema
    assert text == ('{"type":"object","properties":{"z":{"type":"integer","minimum":0},"a":{"type":"string"}},'
                    '"additionalProperties":true}')


def test_numbers_without_bounds_of_their_own_are_bounded():
    """16 digits for an integer, 12 and 6 after the point for a number; a schema's own bound
    leaves it as it is."""
    schema = {"type": "object", "properties": {"i": {"type": "integer"}, "x": {"type": ["number", "null"]},
                                               "mine": {"type": "number", "maximum": 1e30}}}
    bounded = json.loads(parse_params({"json_schema": schema}).json_schema)["properties"]
    assert bounded["i"] == {"type": "integer", "minimum": -(10 ** 16 - 1), "maximum": 10 ** 16 - 1}
    assert bounded["x"] == {"type": ["number", "null"], "minimum": -(10 ** 12 - 1), "maximum": 10 ** 12 - 1,
                            "multipleOf": 1e-6}
    assert bounded["mine"] == {"type": "number", "maximum": 1e30}


def test_a_schema_nested_past_the_limit_is_refused_without_recursion():
    deep = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(CbatchError) as caught:
        parse_params({"json_schema": deep})
    assert caught.value.code == "invalid_request" and f"more than {MAX_SCHEMA_DEPTH} deep" in caught.value.message
    assert parse_params({"json_schema": deep["items"]["items"]}).json_schema.count("items") == MAX_SCHEMA_DEPTH - 2


def test_objects_with_properties_are_closed_unless_they_say_otherwise():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "additionalProperties": True,
                                                     "properties": {}}},
              "$defs": {"d": {"properties": {"e": {}}}}, "allOf": [{"properties": {"f": {}}}],
              "enum": [{"properties": {}}]}
    closed = json.loads(parse_params({"json_schema": schema}).json_schema)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]  # closing a branch would refuse what the others add
    assert closed["enum"] == [{"properties": {}}]  # data, not a schema
    assert "additionalProperties" not in schema  # the caller's schema is left as it was
