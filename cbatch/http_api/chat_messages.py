"""OpenAI chat messages as cbatch's {role, content} messages.

cbatch's messages are text in the system, user and assistant roles, rendered by the
model's chat template. OpenAI's add the `developer` role (the system role), content as a
list of parts, assistant messages that call tools (`tool_calls`) and `tool` messages with a
call's result. An earlier call is told in words ("Called get_weather with {...}.") and its
result becomes a user message naming the function ("get_weather returned: ..."). Not as
the JSON a call is made with (tools.py): shown its own calls in that form, a small model
answers a call's result with the same call again instead of with an answer.
"""

import json

from cbatch.params import invalid


def _text(where: str, content) -> str:
    """Text content: a string, or text parts joined by newlines (parts are separate pieces
    of text: glued, "What is" and "the best book" would read "What isthe best book")."""
    if content is None:
        return ""
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise invalid(f"{where}.content: only text parts are supported")
        return "\n".join(str(part.get("text", "")) for part in content)
    return content


def _calls_of(where: str, tool_calls) -> list[dict]:
    """An assistant message's `tool_calls` as [{"id", "name", "arguments": object}]."""
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
        calls.append({"id": call.get("id"), "name": function["name"], "arguments": arguments})
    return calls


def cbatch_messages(messages) -> list[dict]:
    """The request's `messages` as cbatch's; a `tool` message must answer a call made
    earlier in the conversation (its `tool_call_id`)."""
    if not isinstance(messages, list):
        raise invalid("messages must be a list of {role, content} objects")
    converted, call_names = [], {}  # call id -> function name
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object")
        role, content = message.get("role"), _text(where, message.get("content"))
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in call_names:
                raise invalid(f"{where}.tool_call_id must name a call of an earlier assistant message, "
                              f"got {call_id!r}")
            content = f"{call_names[call_id]} returned: {content}"
            role = "user"
        elif role == "assistant" and message.get("tool_calls"):
            calls = _calls_of(where, message["tool_calls"])
            call_names.update((call["id"], call["name"]) for call in calls)
            said = "\n".join(f"Called {c['name']} with {json.dumps(c['arguments'], ensure_ascii=False)}." for c in calls)
            content = f"{content}\n{said}" if content else said
        converted.append({"role": "system" if role == "developer" else role, "content": content})
    return converted
