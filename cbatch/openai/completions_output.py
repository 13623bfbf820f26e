"""cbatch's results in OpenAI's shapes: whole responses and stream chunks, for the HTTP
server and for cbatch-submit's OpenAI batch files alike."""

import hashlib
import time
import uuid

import cbatch
from cbatch.openai.mapping import CHAT, ApiRequest
from cbatch.openai.reasoning import ReasoningSplitter, split_reasoning
from cbatch.tools import ToolCallStream


def system_fingerprint(model_file_name: str) -> str:
    """What OpenAI's `system_fingerprint` stands for: the serving configuration that can
    change outputs for the same request, here cbatch's version and the model file."""
    digest = hashlib.sha256(f"cbatch {cbatch.__version__} {model_file_name}".encode()).hexdigest()
    return f"fp_{digest[:10]}"


class ResponseBuilder:
    """OpenAI response objects for one API request: whole responses and stream chunks."""

    def __init__(self, request: ApiRequest, fingerprint: str):
        self.request = request
        self.fingerprint = fingerprint
        prefix = "chatcmpl-" if request.kind == CHAT else "cmpl-"
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if request.kind == CHAT else "text_completion"
        self._text_offsets = [0] * len(request.bodies)  # completions logprobs: offset of the next token
        self._tool_streams = [ToolCallStream(request.tools) for _ in request.bodies] if request.tools else None
        self._splitters = [ReasoningSplitter(request.reasoning) for _ in request.bodies] if request.reasoning else None

    def usage(self, usages: list[dict | None]) -> dict:
        """Prompt tokens once per prompt (its choices share it), with those the prefix cache
        served (`prompt_tokens_details.cached_tokens`, as OpenAI's), completion tokens summed."""
        prompt_tokens = cached_tokens = 0
        seen = set()
        for choice, usage in enumerate(usages):
            prompt = self.request.prompt_of_choice[choice]
            if usage and prompt not in seen:
                seen.add(prompt)
                prompt_tokens += usage["prompt_tokens"]
                cached_tokens += usage.get("cached_tokens", 0)
        completion_tokens = sum(u["completion_tokens"] for u in usages if u)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def logprobs(self, choice: int, entries) -> dict | None:
        """A chunk's `logprobs` entries (one per token) in the endpoint's shape."""
        if self.request.top_logprobs is None or entries is None:
            return None
        if self.request.kind == CHAT:
            return {"content": list(entries)}
        offsets = []
        for entry in entries:
            offsets.append(self._text_offsets[choice])
            self._text_offsets[choice] += len(entry["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def whole(self, texts: list[str], finish_reasons: list[str], logprobs: list, usages: list[dict],
              read_by_server: list[tuple[str | None, list | None]]) -> dict:
        """`read_by_server`: per choice, (thinking, tool calls) another server already took
        out of its text (cbatch-submit --url), each None where it did not."""
        choices = []
        for i, (text, reason, lp, (reasoning, calls)) in enumerate(zip(texts, finish_reasons, logprobs,
                                                                        read_by_server)):
            choice = {"index": i, "finish_reason": reason, "logprobs": lp}
            if reasoning is None and self.request.reasoning:
                reasoning, text = split_reasoning(text, self.request.reasoning)
            parsed = self.request.tools.parse(text) if self.request.tools else (text or None, calls) if calls else None
            if parsed:
                choice["message"] = {"role": "assistant", "content": parsed[0], "tool_calls": parsed[1]}
                choice["finish_reason"] = "tool_calls"
            elif self.request.tools and self.request.tools.is_forced and reason == "length":  # a call cut short
                choice["message"] = {"role": "assistant", "content": None,
                                     "tool_calls": self.request.tools.cut_calls(text) or None}
            elif self.request.kind == CHAT:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if self.request.reasoning or read_by_server[i][0] is not None:
                choice["message"]["reasoning_content"] = reasoning or None
            choices.append(choice)
        return self._envelope(self.object, choices, usage=self.usage(usages))

    def role_chunk(self, choice: int) -> dict:
        """A streamed chat choice's first chunk: the role alone, before any content, as
        OpenAI sends it; its content is null when a call is forced (the answer is one)."""
        is_call = self.request.tools is not None and self.request.tools.is_forced
        return self._chat_chunk(choice, {"role": "assistant", "content": None if is_call else ""}, None, None)

    def _chat_chunk(self, choice: int, delta: dict, finish_reason: str | None, logprobs) -> dict:
        entry = {"index": choice, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return self._envelope("chat.completion.chunk", [entry],
                              **({"usage": None} if self.request.include_usage else {}))

    def chunks(self, choice: int, text: str, finish_reason: str | None, logprobs) -> list[dict]:
        """A choice's next streamed chunks for what arrived: one, except with tools, where
        what may be a call is held back until the choice ends (then a tool_calls delta)."""
        if self.request.kind != CHAT:
            entry = {"index": choice, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
            return [self._envelope("text_completion", [entry],
                                   **({"usage": None} if self.request.include_usage else {}))]
        chunks = []
        if self._splitters is not None:
            reasoning, text = self._splitters[choice].push(text, is_last=finish_reason is not None)
            if reasoning:
                chunks.append(self._chat_chunk(choice, {"reasoning_content": reasoning}, None, None))
        if self._tool_streams is None:
            return chunks + [self._chat_chunk(choice, {"content": text} if text else {}, finish_reason, logprobs)]
        deltas, finish_reason = self._tool_streams[choice].push(text, finish_reason)
        chunks += [self._chat_chunk(choice, delta, None, None) for delta in deltas]
        if finish_reason is not None:
            chunks.append(self._chat_chunk(choice, {}, finish_reason, None))
        return chunks

    def usage_chunk(self, usages: list[dict | None]) -> dict:
        obj = "chat.completion.chunk" if self.request.kind == CHAT else "text_completion"
        return self._envelope(obj, [], usage=self.usage(usages))


def _merge_logprobs(kind: str, parts: list | None):
    if parts is None:
        return None
    if kind == CHAT:
        return {"content": [e for p in parts for e in p["content"]]}
    return {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                "text_offset")}


class WholeResponse:
    """One API request's chunks gathered choice by choice into its non-streamed response."""

    def __init__(self, builder: ResponseBuilder):
        self.builder = builder
        num = len(builder.request.bodies)
        self._texts: list[list[str]] = [[] for _ in range(num)]
        self._reasons: list[str | None] = [None] * num
        self._logprobs = [[] if builder.request.top_logprobs is not None else None for _ in range(num)]
        self.usages: list[dict | None] = [None] * num
        self._read_by_server: list[tuple[str | None, list | None]] = [(None, None)] * num
        self.num_left = num

    def add(self, choice: int, chunk) -> None:
        self._texts[choice].append(chunk.text)
        entries = self.builder.logprobs(choice, getattr(chunk, "logprobs", None))
        if entries is not None:
            self._logprobs[choice].append(entries)
        if chunk.finish_reason:
            self._reasons[choice], self.usages[choice] = chunk.finish_reason, chunk.usage
            self._read_by_server[choice] = (getattr(chunk, "reasoning", None), getattr(chunk, "tool_calls", None))
            self.num_left -= 1

    def response(self) -> dict:
        kind = self.builder.request.kind
        return self.builder.whole(["".join(t) for t in self._texts], self._reasons,
                                  [_merge_logprobs(kind, p) for p in self._logprobs], self.usages, self._read_by_server)
