"""A chat as it travels to the decode worker, which renders it with the model's own chat
template (workers/engine/chat_template.py): its messages, calls and results among them,
and the tools offered. Checked where the request arrives (params.parse_request).

The wire's messages are the checked shape cbatch.tools.messages.template_messages makes
of OpenAI's: `{role, content}` in the system, user, assistant and tool roles; an assistant
message may carry `tool_calls` (`[{id, type: "function", function: {name, arguments}}]`,
arguments as an object); a tool message names the call it answers (`tool_call_id`) and
that call's function (`name`). `offered_tools` is OpenAI's list of `{type: "function",
function: {name, description, parameters}}`: a field of its own, since a caller's `tools`
and `tool_choice` are what cbatch.tools prepares into it. A call's arguments and a
function's parameters travel as compact JSON text: the worker hands the template objects
again.
"""

import json
from typing import Literal

import msgspec

from cbatch.text_checks import MAX_PROMPT_CHARS, checked_text, invalid

CHAT_ROLES = ("system", "user", "assistant", "tool")
PLAIN_ROLES = frozenset(CHAT_ROLES[:3])  # a message of these with only role and content is plain text
MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_CALLS = 128  # in one assistant message
MAX_NAME_CHARS = 256  # of a call's id or a function's name
MAX_JSON_CHARS = MAX_PROMPT_CHARS  # of a call's arguments or a function's parameters, written out


class ChatCall(msgspec.Struct, frozen=True, array_like=True):
    id: str
    name: str
    arguments: str  # compact JSON


class ChatMessage(msgspec.Struct, frozen=True, array_like=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ChatCall, ...] = ()  # an assistant's calls
    tool_call_id: str = ""  # a tool message: the call it answers,
    name: str = ""  # and that call's function


class ToolSpec(msgspec.Struct, frozen=True, array_like=True):
    name: str
    description: str
    parameters: str  # a JSON schema as compact JSON


def json_text(name: str, value) -> str:
    """`value` as compact JSON text, refused under `name` when it is not JSON or too long."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as err:
        raise invalid(f"{name} is not JSON: {err}") from None
    return checked_text(name, text, MAX_JSON_CHARS)


def _calls(where: str, value) -> tuple[ChatCall, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_CALLS:
        raise invalid(f"{where}.tool_calls must be a list of at most {MAX_CALLS} calls")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or set(function) != {"name", "arguments"}:
            raise invalid(f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, arguments}}}}")
        calls.append(ChatCall(checked_text(f"{where}.tool_calls[{j}].id", call.get("id", ""), MAX_NAME_CHARS,
                                           allow_empty=True),
                              checked_text(f"{where}.tool_calls[{j}].function.name", function["name"], MAX_NAME_CHARS),
                              json_text(f"{where}.tool_calls[{j}].function.arguments", function["arguments"])))
    return tuple(calls)


def _message(i: int, message) -> ChatMessage:
    """One message checked; a plain {role, content} one takes the short way (most do)."""
    is_dict = type(message) is dict
    role = message.get("role") if is_dict else None
    if is_dict and len(message) == 2 and isinstance(role, str) and role in PLAIN_ROLES and "content" in message:
        return ChatMessage(role, checked_text(f"messages[{i}].content", message["content"],
                                                         MAX_PROMPT_CHARS, allow_empty=True))
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not {"role", "content"} <= set(message):
        raise invalid(f"{where} must be an object with 'role' and 'content'")
    role = message["role"]
    if role not in CHAT_ROLES:
        raise invalid(f"{where}.role must be one of {list(CHAT_ROLES)}, got {role!r}")
    allowed = {"role", "content", *(("tool_calls",) if role == "assistant" else ()),
               *(("tool_call_id", "name") if role == "tool" else ())}
    if set(message) - allowed:
        raise invalid(f"{where} takes only {sorted(allowed)} in the {role} role, got {sorted(set(message))}")
    content = checked_text(f"{where}.content", message["content"], MAX_PROMPT_CHARS, allow_empty=True)
    if role == "tool":
        return ChatMessage(role, content, tool_call_id=checked_text(
            f"{where}.tool_call_id", message.get("tool_call_id"), MAX_NAME_CHARS, allow_empty=True),
            name=checked_text(f"{where}.name", message.get("name", ""), MAX_NAME_CHARS, allow_empty=True))
    calls = _calls(where, message["tool_calls"]) if "tool_calls" in message else ()
    return ChatMessage(role, content, tool_calls=calls)


def parse_messages(value) -> tuple[ChatMessage, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise invalid("messages must be a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        raise invalid(f"messages takes at most {MAX_MESSAGES} entries")
    return tuple(_message(i, message) for i, message in enumerate(value))


def parse_tools(value) -> tuple[ToolSpec, ...]:
    """The tools offered (None or []: none), for the template to describe."""
    if value is None or value == []:
        return ()
    if not isinstance(value, (list, tuple)) or len(value) > MAX_TOOLS:
        raise invalid(f"offered_tools must be a list of at most {MAX_TOOLS} {{type: function, function}} objects")
    tools = []
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("parameters", {}), dict):
            raise invalid(f"offered_tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}")
        where = f"offered_tools[{i}].function"
        tools.append(ToolSpec(checked_text(f"{where}.name", function.get("name"), MAX_NAME_CHARS),
                              checked_text(f"{where}.description", function.get("description", ""), MAX_JSON_CHARS,
                                           allow_empty=True),
                              json_text(f"{where}.parameters", function.get("parameters", {}))))
    return tuple(tools)


def template_input(messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...]) -> tuple[list[dict], list | None]:
    """(messages, tools) in the shape chat templates read: calls' arguments and functions'
    parameters as objects again; tools None when none are offered."""
    dicts = []
    for message in messages:
        entry = {"role": message.role, "content": message.content}
        if message.tool_calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": json.loads(call.arguments)}} for call in message.tool_calls]
        if message.role == "tool":
            entry.update(tool_call_id=message.tool_call_id, name=message.name)
        dicts.append(entry)
    offered = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                 "parameters": json.loads(tool.parameters)}} for tool in tools]
    return dicts, offered or None


def has_tool_turns(messages: tuple[ChatMessage, ...]) -> bool:
    return any(message.role == "tool" or message.tool_calls for message in messages)
