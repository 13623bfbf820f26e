"""`POST /v1/responses` requests as chat requests, served by the same engine path.

Stateless: `input` (text, or message / function_call / function_call_output items) and
`instructions` are the whole conversation. `previous_response_id` (a stored conversation)
is refused with a 400 naming it; `store` is accepted and ignored (nothing is stored, so
nothing can be retrieved later). Responses' flat function tools and tool choices are
mapped onto chat's (cbatch/tools), `max_output_tokens` onto `max_tokens`, `reasoning.effort`
onto a thinking budget (reasoning.py).
"""

import json

from cbatch.openai.mapping import CHAT, ApiRequest, parse_api_request
from cbatch.params import invalid

# Responses fields passed to the chat request as they are.
SAME_FIELDS = ("temperature", "top_p", "parallel_tool_calls", "stream", "reasoning_budget", "seed", "grammar",
               "logit_bias", "top_k", "min_p", "presence_penalty", "frequency_penalty", "priority", "timeout")
TEXT_PARTS = ("input_text", "output_text", "text")


def _text_of(where: str, content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(
            isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str)
            for part in content):
        raise invalid(f"{where}.content must be a string or a list of input_text parts")
    return "\n".join(part["text"] for part in content)


def _content_of(where: str, content):
    """A message item's content for chat: its text, or chat's parts when it holds
    `input_image` parts (an image_url each, which the chat mapping takes)."""
    if not isinstance(content, list) or not any(isinstance(part, dict) and part.get("type") == "input_image"
                                                for part in content):
        return _text_of(where, content)
    return [{"type": "image_url", "image_url": {"url": part.get("image_url")}} if part.get("type") == "input_image"
            else {"type": "text", "text": _text_of(where, [part])} for part in content]


def chat_messages(raw_input, instructions) -> list[dict]:
    """`instructions` and `input` as chat messages; consecutive function_call items make
    one assistant message calling them."""
    messages = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw_input, str):
        return messages + [{"role": "user", "content": raw_input}]
    if not isinstance(raw_input, list) or not raw_input:
        raise invalid("input must be a string or a non-empty list of input items")
    call_ids = set()
    for i, item in enumerate(raw_input):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ("user", "assistant", "system", "developer"):
                raise invalid(f"{where}.role must be user, assistant, system or developer")
            messages.append({"role": item["role"], "content": _content_of(where, item.get("content"))})
        elif kind == "function_call":
            _add_call(messages, where, item)
            call_ids.add(item["call_id"])
        elif kind == "function_call_output":
            if item.get("call_id") not in call_ids:
                raise invalid(f"{where}.call_id must name an earlier function_call item's call_id, "
                              f"got {item.get('call_id')!r}")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text_of(where, output)})
        elif kind != "reasoning":  # earlier thinking is not shown to the model again
            raise invalid(f"{where}.type must be message, function_call, function_call_output or reasoning, "
                          f"got {kind!r}")
    return messages


def _add_call(messages: list[dict], where: str, item: dict) -> None:
    """A function_call item as a call of the assistant message before it, when that one
    only calls, else of a new one."""
    if not all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
        raise invalid(f"{where} must be {{type: function_call, call_id, name, arguments}}")
    try:
        json.loads(item["arguments"])
    except json.JSONDecodeError:
        raise invalid(f"{where}.arguments is not JSON") from None
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    if messages and messages[-1].get("tool_calls") and messages[-1]["content"] is None:
        messages[-1]["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _chat_tools(raw: dict) -> dict:
    """Responses' tools ({type: function, name, description, parameters}) and
    tool_choice ({type: function, name}) in chat's shape."""
    tools, choice = raw.get("tools"), raw.get("tool_choice")
    fields = {}
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
            raise invalid("tools must be a list of {type: function, name, description, parameters} objects")
        fields["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    if isinstance(choice, dict) and choice.get("type") == "function":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        fields["tool_choice"] = choice
    if tools == [] and choice in (None, "auto", "none"):
        fields.pop("tools")
    return fields


def _response_format(text) -> dict | None:
    """`text.format` (Responses' structured output) as chat's `response_format`."""
    if not isinstance(text, dict) or not isinstance(text.get("format", {}), dict):
        raise invalid("text must be an object: {format: {type: text | json_object | json_schema, ...}}")
    spec = text.get("format")
    if spec is None or spec.get("type") == "text":
        return None
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": spec.get("schema"),
                                                       "strict": spec.get("strict")}}
    return spec


def parse_responses_request(raw, model_names: list[str], reasoning: dict | None, *,
                            tool_format=None, keeps_billing_header: bool = False) -> ApiRequest:
    if not isinstance(raw, dict):
        raise invalid("the request body must be a JSON object")
    if raw.get("previous_response_id") is not None:
        raise invalid("previous_response_id is not supported: this server stores no responses; send the whole "
                      "conversation in input")
    if raw.get("background"):
        raise invalid("background is not supported: this server stores no responses to fetch later")
    chat = {name: raw[name] for name in SAME_FIELDS if raw.get(name) is not None}
    max_tokens = raw.get("max_output_tokens")
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise invalid(f"max_output_tokens must be a positive integer, got {max_tokens!r}")
        chat["max_tokens"] = max_tokens
    effort = raw.get("reasoning")
    if effort is not None:
        if not isinstance(effort, dict):
            raise invalid("reasoning must be an object: {effort}")
        chat["reasoning_effort"] = effort.get("effort")
    chat.update(_chat_tools(raw))
    if raw.get("text") is not None:
        chat["response_format"] = _response_format(raw["text"])
    chat["messages"] = chat_messages(raw.get("input"), raw.get("instructions"))
    if "model" in raw:
        chat["model"] = raw["model"]
    api = parse_api_request(CHAT, chat, model_names, reasoning, tool_format=tool_format,
                            keeps_billing_header=keeps_billing_header)
    if len(api.bodies) != 1:
        raise invalid("a response has one output")
    api.schema_field = "text" if api.schema_field else None  # text.format, sent as the chat's response_format
    return api
