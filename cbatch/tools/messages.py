"""OpenAI chat messages, checked once, in the two forms a prompt is made from.

OpenAI's messages add to cbatch's {role, content} the `developer` role (the system role),
content as a list of parts, assistant messages that call tools (`tool_calls`) and `tool`
messages with a call's result (`tool_call_id`, which must answer a call made earlier).

- template_messages: for a chat template that knows tools, which the decode worker
  renders them with, in the shape Hugging Face templates read (cbatch/chat_messages.py
  is that wire shape): calls' arguments as objects, a result named after its function.
- cbatch_messages: text in the system, user and assistant roles, for a template that
  does not know tools (rendered in the decode worker). An earlier call is told in words
  ("Called get_weather with {...}.") and its result becomes a user message naming the
  function ("get_weather returned: ..."). Not as the JSON a call is made with (formats.py):
  shown its own calls in that form, a small model answers a call's result with the same
  call again instead of with an answer.
"""

import json

from cbatch.params import invalid

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(where: str, content) -> str:
    """Text content: a string, or text parts joined by newlines (parts are separate pieces
    of text: glued, "What is" and "the best book" would read "What isthe best book")."""
    if content is None:
        return ""
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise invalid(f"{where}.content: only text parts are supported")
        return "\n".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text parts")
    return content


def _call_id(where: str, value) -> str:
    """A call's id as text: some clients send none (then "") or a number."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise invalid(f"{where} must be a string, got {type(value).__name__}")
    return str(value)


def _calls_of(where: str, tool_calls) -> list[dict]:
    """An assistant message's `tool_calls` with their arguments as objects."""
    if not isinstance(tool_calls, list):
        raise invalid(f"{where}.tool_calls must be a list")
    calls = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, arguments}}}}")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise invalid(f"{where}.tool_calls[{j}].function.arguments is not JSON") from None
        calls.append({"id": _call_id(f"{where}.tool_calls[{j}].id", call.get("id")), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def template_messages(messages) -> list[dict]:
    """The request's `messages` checked, as {role, content[, tool_calls][, tool_call_id, name]}."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {role, content} objects")
    checked, call_names = [], {}  # call id -> function name
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise invalid(f"{where} must be an object with a role among {list(ROLES)}")
        role = "system" if message["role"] == "developer" else message["role"]
        entry = {"role": role, "content": _text(where, message.get("content"))}
        if role == "tool":
            call_id = _call_id(f"{where}.tool_call_id", message.get("tool_call_id"))
            if call_id not in call_names:
                raise invalid(f"{where}.tool_call_id must name a call of an earlier assistant message, "
                              f"got {call_id!r}")
            entry.update(tool_call_id=call_id, name=call_names[call_id])
        elif role == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = _calls_of(where, message["tool_calls"])
            call_names.update((call["id"], call["function"]["name"]) for call in entry["tool_calls"])
        checked.append(entry)
    return checked


def cbatch_messages(messages) -> list[dict]:
    """The request's `messages` as cbatch's {role, content} messages, calls and results in words."""
    converted = []
    for message in template_messages(messages):
        content = message["content"]
        if message["role"] == "tool":
            content = f"{message['name']} returned: {content}"
        elif message.get("tool_calls"):
            said = "\n".join(f"Called {c['function']['name']} with "
                             f"{json.dumps(c['function']['arguments'], ensure_ascii=False)}."
                             for c in message["tool_calls"])
            content = f"{content}\n{said}" if content else said
        converted.append({"role": "user" if message["role"] == "tool" else message["role"], "content": content})
    return converted
