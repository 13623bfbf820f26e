"""A `/v1/responses` answer as output items and the events OpenAI streams them with.

One ResponseEvents per request takes the answer's text as it arrives and returns the
events it makes: `response.created` and `response.in_progress`; per output item
`response.output_item.added`, its content part's `.added`, text deltas and `.done`s,
`response.output_item.done`; at the end `response.completed`, or `response.incomplete`
(ENDINGS: max_output_tokens or the request's timeout cut the answer, or it was
cancelled), each with its `sequence_number`. Thinking is a
`reasoning` item (reasoning_text deltas) before the `message` item; a tool call is a
`function_call` item, with its arguments' delta and done events. A response that does
not stream is the same events' last response.
"""

import time
import uuid

from cbatch.openai.answer_parts import AnswerParts
from cbatch.openai.mapping import ApiRequest

# output item type -> (content part type, its delta event, its done event)
PARTS = {"message": ("output_text", "response.output_text.delta", "response.output_text.done"),
         "reasoning": ("reasoning_text", "response.reasoning_text.delta", "response.reasoning_text.done")}
# finish reason -> (the response's status, its incomplete_details.reason) for an answer cut
# short; any other finish completes it. OpenAI's reasons name no deadline: one the request's
# timeout cut has none (a reason of cbatch's own would fail clients that check the values).
# Responses stream no event of their own for a cancelled response: its last is response.incomplete.
ENDINGS = {"length": ("incomplete", "max_output_tokens"), "timeout": ("incomplete", None),
           "cancelled": ("cancelled", None)}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def echoed_fields(raw: dict) -> dict:
    """What the response repeats of the request (OpenAI's response object carries them)."""
    tools = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": bool(t.get("strict", False))}
             for t in raw.get("tools") or []]
    return {"instructions": raw.get("instructions"), "metadata": raw.get("metadata") or {}, "tools": tools,
            "tool_choice": raw.get("tool_choice") or "auto",
            "parallel_tool_calls": raw.get("parallel_tool_calls", True),
            "temperature": raw.get("temperature"), "top_p": raw.get("top_p"),
            "max_output_tokens": raw.get("max_output_tokens"), "previous_response_id": None,
            "text": raw.get("text") or {"format": {"type": "text"}}, "store": False}


class ResponseEvents:
    def __init__(self, api: ApiRequest, echoed: dict):
        self.api, self.echoed = api, echoed
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item being streamed
        self._num_events = 0
        self._parts = AnswerParts(api)
        self._num_reasoning_tokens = 0

    def event(self, kind: str, **fields) -> dict:
        self._num_events += 1
        return {"type": kind, "sequence_number": self._num_events - 1, **fields}

    def response(self, status: str = "in_progress", usage: dict | None = None, cut_by: str | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.api.model, "output": list(self.output), "error": None,
                "incomplete_details": {"reason": cut_by} if status == "incomplete" else None,
                "usage": usage and {
                    "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                    "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                    "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0), "cache_write_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": self._num_reasoning_tokens}},
                **self.echoed}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def push(self, text: str, num_tokens: int, finish_reason: str | None, usage: dict | None) -> list[dict]:
        """The events for the answer's next text (and its end, with a finish reason)."""
        reasoning, deltas, finish_reason = self._parts.push(text, finish_reason)
        events = []
        if reasoning:  # thinking tokens: those of the rounds that carried thinking
            self._num_reasoning_tokens += num_tokens
            events += self._text("reasoning", reasoning)
        for delta in deltas:
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls", []):
                events += self._close("completed") + self._function_call(call)
        if finish_reason is None:
            return events
        status, cut_by = ENDINGS.get(finish_reason, ("completed", None))
        events += self._close("completed" if status == "completed" else "incomplete")
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self.event(kind, response=self.response(status, usage, cut_by))]

    def _text(self, kind: str, text: str) -> list[dict]:
        """A text delta of a reasoning or message item; a new item when the kind changes."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            part = {"type": PARTS[kind][0], "text": ""}
            if kind == "message":
                item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                part["annotations"] = []
            else:
                item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            self._open, self._open_text = item, []
            events += [self.event("response.output_item.added", output_index=len(self.output), item=item),
                       self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                                   content_index=0, part=part)]
        self._open_text.append(text)
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(PARTS[kind][1], item_id=self._open["id"], output_index=len(self.output),
                                     content_index=0, delta=text, **extra)]

    def _close(self, status: str) -> list[dict]:
        """The open item's done events; it joins the output."""
        item, self._open = self._open, None
        if item is None:
            return []
        kind, text, index = item["type"], "".join(self._open_text), len(self.output)
        part = {"type": PARTS[kind][0], "text": text, **({"annotations": []} if kind == "message" else {})}
        item = {**item, "content": [part], "status": status}
        self.output.append(item)
        extra = {"logprobs": []} if kind == "message" else {}
        return [self.event(PARTS[kind][2], item_id=item["id"], output_index=index, content_index=0, text=text,
                            **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _function_call(self, call: dict) -> list[dict]:
        index, function = len(self.output), call["function"]
        item = {"id": _new_id("fc"), "type": "function_call", "call_id": call["id"], "name": function["name"],
                "arguments": "", "status": "in_progress"}
        done = {**item, "arguments": function["arguments"], "status": "completed"}
        self.output.append(done)
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=function["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=function["name"], arguments=function["arguments"]),
                self.event("response.output_item.done", output_index=index, item=done)]


class WholeResponseEvents:
    """A response that does not stream, gathered chunk by chunk as a batch line's answer is
    (cbatch.batch.openai_batch: the interface of completions_output.WholeResponse): the last
    event's response, as the live endpoint answers it."""

    def __init__(self, events: ResponseEvents):
        self.events = events
        self.num_left = 1  # a response has one output
        self._response: dict | None = None

    def add(self, choice: int, chunk) -> None:
        made = self.events.push(chunk.text, len(getattr(chunk, "token_ids", None) or ()), chunk.finish_reason,
                                chunk.usage)
        if made and made[-1]["type"] in ("response.completed", "response.incomplete"):
            self._response, self.num_left = made[-1]["response"], 0

    def response(self) -> dict:
        return self._response
