"""`POST /v1/messages` (Anthropic's Messages API) as a chat request, served by the same
engine path as `/v1/chat/completions`: the same request struct, scheduler, tenants,
priorities, structured output and images.

What is mapped: `system` (a string or text blocks) and every `system` message in the
middle of `messages` (recent Claude Code sends them; strict servers refuse them) become
one system prompt, in order; a message's content is a string or blocks: `text`, `image`
(a base64 or url `source`), an assistant's `tool_use` (a chat call, its `input` as the
arguments) and a user's `tool_result` (a tool message answering that call, its content a
string or text blocks); `thinking` blocks of earlier turns, blocks of other types and
`cache_control` fields are accepted and left out, not refused. `max_tokens` (required),
`stop_sequences`, `temperature`, `top_p`, `top_k`, `tools` (`input_schema` as the
parameters), `tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`),
`thinking` (`enabled` with `budget_tokens` as the thinking budget, `disabled` as a budget
of 0, both only on a model that thinks in tags), `output_config.format` (a JSON schema the
answer follows) and `stream`; `metadata` and `cache_control` are ignored (the prefix
cache serves every repeated prefix without being asked).
"""

import json

from cbatch.openai.mapping import CHAT, ApiRequest, parse_api_request
from cbatch.params import invalid

# Anthropic's sampling fields, and cbatch's own that a client may add (`extra_body` in the SDK).
SAME_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "logit_bias", "min_tokens", "repeat_penalty",
               "presence_penalty", "frequency_penalty", "priority", "timeout")


def _texts(where: str, content) -> list[str]:
    """The text of a string or of the text blocks of a block list (other blocks left out)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of content blocks")
    return [block["text"] for block in content if isinstance(block, dict) and block.get("type") == "text"
            and isinstance(block.get("text"), str)]


def _image_part(where: str, block: dict) -> dict:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    elif isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise invalid(f"{where}.source must be {{type: base64, media_type, data}} or {{type: url, url}}")
    return {"type": "image_url", "image_url": {"url": url}}


def _user_messages(where: str, content) -> list[dict]:
    """A user turn: a tool message for each tool_result (first, as they answer the calls
    before), then its text and images as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content blocks")
    results, parts = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            text = "\n".join(_texts(f"{where}.content[{j}].content", block.get("content", "")))
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(f"{where}.content[{j}]", block))
    if not parts:
        return results
    has_images = any(part["type"] == "image_url" for part in parts)
    text = "\n".join(part["text"] for part in parts if part["type"] == "text")
    return results + [{"role": "user", "content": parts if has_images else text}]


def _assistant_message(where: str, content) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content blocks")
    calls = [{"id": block.get("id"), "type": "function",
              "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}}
             for block in content if isinstance(block, dict) and block.get("type") == "tool_use"]
    text = "".join(_texts(f"{where}.content", content))
    return {"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}


def chat_messages(raw_system, raw_messages) -> list[dict]:
    """`system` and `messages` as chat messages, every system text first, in order; no
    messages at all are one empty user turn (llama-server's leniency, which its tests hold)."""
    if not isinstance(raw_messages, list):
        raise invalid("messages must be a list of {role, content} objects")
    raw_messages = raw_messages or [{"role": "user", "content": ""}]
    system = [] if raw_system is None else _texts("system", raw_system)
    messages = []
    for i, message in enumerate(raw_messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "system":
            system += _texts(f"{where}.content", message.get("content"))
        elif role == "user":
            messages += _user_messages(where, message.get("content"))
        elif role == "assistant":
            messages.append(_assistant_message(where, message.get("content")))
        else:
            raise invalid(f"{where}.role must be user or assistant, got {role!r}")
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + messages


def _tools(raw_tools, raw_choice) -> dict:
    """`tools` and `tool_choice` as chat's."""
    if raw_tools is None:
        return {}
    if not isinstance(raw_tools, list):
        raise invalid("tools must be a list of {name, description, input_schema} objects")
    tools = [{"type": "function", "function": {"name": tool.get("name"), "description": tool.get("description", ""),
                                               "parameters": tool.get("input_schema", {"type": "object"})}}
             for tool in raw_tools if isinstance(tool, dict) and tool.get("type") in (None, "custom")]
    if not tools:  # only server tools (web search and the like), which run at Anthropic's
        return {}
    choice = raw_choice or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise invalid(f"tool_choice must be {{type: auto | any | tool | none}}, got {raw_choice!r}")
    return {"tools": tools, "tool_choice": mapped, "parallel_tool_calls": not choice.get("disable_parallel_tool_use")}


def _thinking(raw, reasoning: dict | None) -> dict:
    """`thinking` as a thinking budget, on a model that thinks in tags (others ignore it,
    as Claude Code sends it to any model)."""
    if raw is None or reasoning is None:
        return {}
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "disabled":
        return {"reasoning_budget": 0}
    budget = raw.get("budget_tokens") if kind == "enabled" else None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise invalid("thinking must be {type: enabled, budget_tokens: N} or {type: disabled}")
    return {"reasoning_budget": budget}


def _output_format(raw: dict) -> dict:
    """Structured output: `output_config.format` (or the older `output_format`) with a JSON
    schema, as chat's response_format."""
    config = raw.get("output_config")
    spec = config.get("format") if isinstance(config, dict) else raw.get("output_format")
    if spec is None:
        return {}
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise invalid("output_config.format must be {type: json_schema, schema: {...}}")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"]}}}


def parse_messages_request(raw: dict, model_names: list[str], reasoning: dict | None, *, tool_format=None,
                           keeps_billing_header: bool = False) -> ApiRequest:
    if not isinstance(raw, dict):
        raise invalid("the request body must be a JSON object")
    max_tokens = raw.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise invalid(f"max_tokens is required: a positive integer, got {max_tokens!r}")
    stop = raw.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise invalid("stop_sequences must be a list of strings")
    chat = {"model": raw.get("model"), "messages": chat_messages(raw.get("system"), raw.get("messages")),
            "max_tokens": max_tokens, "stream": bool(raw.get("stream")),
            **({"stream_options": {"include_usage": True}} if raw.get("stream") else {}),
            **({"stop": stop} if stop else {}),
            **{name: raw[name] for name in SAME_FIELDS if raw.get(name) is not None},
            **_tools(raw.get("tools"), raw.get("tool_choice")), **_thinking(raw.get("thinking"), reasoning),
            **_output_format(raw)}
    api = parse_api_request(CHAT, chat, model_names, reasoning, tool_format=tool_format,
                            keeps_billing_header=keeps_billing_header)
    api.schema_field = "output_config" if api.schema_field else None  # sent as the chat's response_format
    return api
