"""A `/v1/messages` answer in Anthropic's shapes: the message object, and its stream of
events (`message_start`, `ping`, then for each content block `content_block_start`, its
`content_block_delta`s and `content_block_stop`, then `message_delta` with the stop reason
and usage, and `message_stop`).

Blocks come in the order the model wrote them: `thinking` (the text inside the thinking
block, for a model that thinks in tags: cbatch/openai/reasoning.py), `text`, and a
`tool_use` block per call read from the answer (cbatch/tools), whose `input` streams as one
`input_json_delta`. Stop reasons: `end_turn`, `max_tokens`, `tool_use`, `stop_sequence`
(with the stop sequence that ended the answer). Usage:
`input_tokens` (the prompt's tokens the prefix cache did not serve),
`cache_read_input_tokens` (those it did) and `output_tokens`.
"""

import json
import uuid

from cbatch.errors import CbatchError
from cbatch.openai.answer_parts import AnswerParts
from cbatch.openai.mapping import ApiRequest, error_status

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
EMPTY_BLOCKS = {"thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}
DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}
# HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(err: CbatchError, param: str | None = None) -> dict:
    """Anthropic's error shape, the type told by the status cbatch's code maps to."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error_status(err.code), "api_error"),
                                       "message": err.message}}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def message_usage(usage: dict | None) -> dict:
    usage = usage or {}
    cached = usage.get("cached_tokens", 0)
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": usage.get("completion_tokens", 0)}


class MessageEvents:
    """One request's events, pushed as its text arrives; `message` is whole at the end."""

    def __init__(self, api: ApiRequest):
        self.message = {"id": new_message_id(), "type": "message", "role": "assistant", "model": api.model,
                        "content": [], "stop_reason": None, "stop_sequence": None, "usage": message_usage(None)}
        self._parts = AnswerParts(api)
        self._open: dict | None = None  # the thinking or text block being streamed

    def start(self, prompt_tokens: int = 0) -> list[dict]:
        """The stream's opening: the message without content, its usage the prompt's tokens
        (message_delta's at the end tells what the prefix cache served), then a `ping`, as
        Anthropic's begin."""
        usage = {**self.message["usage"], "input_tokens": prompt_tokens}
        return [{"type": "message_start", "message": {**self.message, "content": [], "usage": usage}},
                {"type": "ping"}]

    def push(self, text: str, finish_reason: str | None, usage: dict | None, stop_string: str | None = None
             ) -> list[dict]:
        """The events of the answer's next text (and of its end, with a finish reason, and
        the stop sequence that ended it, if one did)."""
        reasoning, deltas, finish_reason = self._parts.push(text, finish_reason)
        events = self._text("thinking", reasoning) if reasoning else []
        for delta in deltas:
            if delta.get("content"):
                events += self._text("text", delta["content"])
            for call in delta.get("tool_calls", []):
                events += self._close() + self._tool_use(call)
        if finish_reason is None:
            return events
        if not self.message["content"] and self._open is None:  # an empty answer is still one text block
            events += self._text("text", "")
        events += self._close()
        self.message["stop_reason"] = "stop_sequence" if stop_string else STOP_REASONS.get(finish_reason, "end_turn")
        self.message["stop_sequence"] = stop_string or None
        self.message["usage"] = message_usage(usage)
        return events + [{"type": "message_delta", "delta": {"stop_reason": self.message["stop_reason"],
                                                             "stop_sequence": self.message["stop_sequence"]},
                          "usage": self.message["usage"]},
                         {"type": "message_stop"}]

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            self._open = dict(EMPTY_BLOCKS[kind])
            events.append({"type": "content_block_start", "index": len(self.message["content"]),
                           "content_block": dict(EMPTY_BLOCKS[kind])})
        if not text:
            return events
        delta_type, field = DELTAS[kind]
        self._open[field] += text
        return events + [{"type": "content_block_delta", "index": len(self.message["content"]),
                          "delta": {"type": delta_type, field: text}}]

    def _close(self) -> list[dict]:
        """The open block's end; a thinking block's (empty) signature first, as Anthropic's
        clients expect one before its stop."""
        block, self._open = self._open, None
        if block is None:
            return []
        index = len(self.message["content"])
        self.message["content"].append(block)
        signature = ([{"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta",
                                                                                "signature": ""}}]
                     if block["type"] == "thinking" else [])
        return signature + [{"type": "content_block_stop", "index": index}]

    def _tool_use(self, call: dict) -> list[dict]:
        index = len(self.message["content"])
        arguments = call["function"]["arguments"]
        try:
            arguments_object = json.loads(arguments)
        except json.JSONDecodeError:  # a forced call max_tokens cut: its input as far as written is lost
            arguments_object = {}
        block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                 "name": call["function"]["name"], "input": arguments_object}
        self.message["content"].append(block)
        return [{"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": arguments}},
                {"type": "content_block_stop", "index": index}]
