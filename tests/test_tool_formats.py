"""cbatch.tools without a daemon: the call formats chat templates teach (read back, the
grammar the decode worker builds for a forced call in each, and named in the handshake),
the streamed hold-back of what may be a call, and the decode worker's sandboxed template's
globals and errors. The daemon runs are
tests/test_tools*.py."""

import json

import pytest

from cbatch.errors import CbatchError
from cbatch.params import parse_params, parse_request
from cbatch.tools import ToolCallStream, format_of, prepare_chat, tool_plan
from cbatch.tools.formats import BareJson, Tagged
from cbatch.tools.messages import template_messages
from cbatch.workers.engine.chat_template import ChatTemplate, compiled_template, tool_format
from cbatch.workers.engine.structured.tool_grammar import tool_call_grammar

CITY = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": CITY}} for name in ("get_weather", "get_time")]
LLAMA31_LIKE = ('{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}Respond in the format '
                '{"name": function name, "parameters": dictionary of argument name and its value}.{% endif %}')


def plan(choice="auto", call_format=Tagged(), **extra):
    return tool_plan({"tools": TOOLS, "tool_choice": choice, **extra}, call_format)


def test_tagged_calls_are_read_with_the_text_around_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>')
    content, calls = plan().parse(text)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"city": "Rome"})]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # not an offered function
    '<tool_call>{"name": "get_time", "arguments": {</tool_call>',  # cut short
    'The weather is fine.',
])
def test_what_is_not_a_call_of_an_offered_function_is_no_call(text):
    assert plan().parse(text) is None


def test_a_bare_json_call_with_parameters_is_read_and_that_format_is_told_from_the_template():
    template = ChatTemplate(LLAMA31_LIKE)
    assert template.knows_tools and isinstance(template.call_format, BareJson)
    assert template.call_format.arguments_key == "parameters"
    _, (call,) = plan(call_format=template.call_format).parse(' {"name": "get_time", "parameters": {"city": "Lima"}}')
    assert json.loads(call["function"]["arguments"]) == {"city": "Lima"}
    tool_call = parse_params({"tool_call": plan("required", template.call_format).constraint()}).tool_call
    assert r'\"parameters\"' in tool_call_grammar(tool_call)  # a JSON key in a Lark literal


def test_a_stream_releases_text_until_a_call_may_begin_and_ends_with_the_calls():
    stream = ToolCallStream(plan())
    pieces = ["Sure, ", "one moment <tool_", 'call>\n{"name": "get_time", ',
              '"arguments": {"city": "Oslo"}}\n</tool_call>']
    deltas = [stream.push(piece, None)[0] for piece in pieces]
    assert deltas == [[{"content": "Sure, "}], [{"content": "one moment "}], [], []]
    end, reason = stream.push("", "stop")
    assert reason == "tool_calls" and end[0]["tool_calls"][0]["function"]["name"] == "get_time"


def test_a_stream_lets_a_lone_angle_bracket_go_once_it_cannot_be_a_call():
    stream = ToolCallStream(plan())
    assert stream.push("a <to", None) == ([{"content": "a "}], None)
    assert stream.push("y> b", None) == ([{"content": "<toy> b"}], None)
    assert stream.push("", "stop") == ([], "stop")


def test_the_template_gets_raise_exception_strftime_now_and_bos_once():
    template = ChatTemplate("{{ bos_token }}{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}"
                            "{% endif %}{{ strftime_now('%Y') | length }}{{ messages[0].content }}{{ tools | length }}",
                            bos_token="<s>", adds_bos=True)
    assert template.render(template_messages([{"role": "user", "content": "hi"}]), TOOLS) == "4hi2"
    with pytest.raises(CbatchError, match="user first") as caught:
        template.render(template_messages([{"role": "assistant", "content": "hi"}]), None)
    assert caught.value.code == "invalid_request"


def test_the_sandbox_refuses_what_a_model_file_must_not_do():
    template = ChatTemplate("{{ tools.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(CbatchError, match="cannot render"):
        template.render(template_messages([{"role": "user", "content": "hi"}]), TOOLS)


def test_only_a_template_that_knows_tools_names_a_call_format_to_clients():
    smollm2_like = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert tool_format(ChatTemplate(smollm2_like)) == {} and tool_format(None) == {}
    assert compiled_template("{% if", "", "", False) is None  # jinja2 cannot compile it: llama.cpp's renderer may
    told = tool_format(ChatTemplate(LLAMA31_LIKE))
    assert told == {"tool_format": {"name": "bare_json", "arguments_key": "parameters"}}
    assert isinstance(format_of(told), BareJson) and format_of(told).arguments_key == "parameters"
    assert isinstance(format_of({"tool_format": {"name": "tagged", "arguments_key": "arguments"}}), Tagged)
    assert format_of({}) is None and format_of(None) is None
    assert format_of({"tool_format": {"name": "json_answer"}}) is None  # cbatch's own is taught in words


def test_a_call_without_an_id_or_with_a_number_for_one_reaches_the_template_as_text():
    """Some clients send calls without ids, or numbers for them: the result still names its
    call, and the daemon takes both; an id of another type is refused by name."""
    calls = [{"type": "function", "function": {"name": "get_time", "arguments": "{}"}},
             {"id": 7, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": 7, "content": "rain"}]
    body, _ = prepare_chat({"messages": history, "tools": TOOLS}, Tagged())
    request = parse_request(1, body)
    assert [call.id for call in request.messages[1].tool_calls] == ["", "7"]
    assert (request.messages[2].tool_call_id, request.messages[2].name) == ("7", "get_weather")
    with pytest.raises(CbatchError, match=r"messages\[2\].tool_call_id must be a string"):
        prepare_chat({"messages": [*history[:2], {**history[2], "tool_call_id": ["x"]}], "tools": TOOLS}, Tagged())
