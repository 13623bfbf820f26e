"""OpenAI request bodies mapped onto cbatch's, and cbatch's results into OpenAI's shapes.

Used by the HTTP server and by cbatch-submit's OpenAI batch files, so both accept the
same fields. Fields cbatch knows are passed to the daemon, which validates them (a bad
value is an `invalid_request`, HTTP 400); unknown fields are ignored as OpenAI does.
"""

import json
import re
import time
import uuid
from dataclasses import dataclass

from cbatch.errors import (CbatchError, DECODE_FAILED, INTERNAL, INVALID_REQUEST, NOT_FOUND, PROMPT_TOO_LONG, UNAUTHORIZED,
                           QUEUE_FULL, SHUTTING_DOWN, UNAVAILABLE, WORKER_RESTARTED)
from cbatch.params import MAX_TOP_LOGPROBS, expand_choices, invalid

CHAT, COMPLETION = "chat", "completion"
RETRY_AFTER_S = 1  # what a 429 tells the caller to wait
# Completions (prompts x n) one request may ask for: each is a request of its own in the
# daemon's queue, and more than this is a batch job, for a batch file.
MAX_CHOICES_PER_REQUEST = 256
# OpenAI fields with the same name and meaning in cbatch's request body.
PASSTHROUGH_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                      "repeat_penalty", "seed", "ignore_eos", "min_tokens", "logit_bias", "grammar")
# cbatch error code -> (HTTP status, OpenAI error type)
_STATUS = {
    INVALID_REQUEST: (400, "invalid_request_error"),
    PROMPT_TOO_LONG: (400, "invalid_request_error"),
    NOT_FOUND: (404, "invalid_request_error"),
    UNAUTHORIZED: (401, "authentication_error"),
    QUEUE_FULL: (429, "rate_limit_error"),
    SHUTTING_DOWN: (503, "service_unavailable"),
    UNAVAILABLE: (503, "service_unavailable"),
    WORKER_RESTARTED: (503, "service_unavailable"),
    DECODE_FAILED: (500, "server_error"),
    INTERNAL: (500, "server_error"),
}
_LEADING_NAME = re.compile(r"^([a-z_]+)")


def error_status(code: str) -> int:
    return _STATUS.get(code, (500, "server_error"))[0]


def error_body(err: CbatchError, param: str | None = None) -> dict:
    """OpenAI's error shape with cbatch's stable code. `param` is the field at fault: the
    daemon's messages start with the field's name."""
    if param is None:
        name = _LEADING_NAME.match(err.message)
        known = PASSTHROUGH_FIELDS + ("max_tokens", "stop", "prompt", "messages", "n", "logprobs", "model")
        param = name.group(1) if name and name.group(1) in known else None
    return {"error": {"message": err.message, "type": _STATUS.get(err.code, (500, "server_error"))[1],
                      "param": param, "code": err.code}}


@dataclass
class ApiRequest:
    kind: str  # CHAT or COMPLETION
    bodies: list[dict]  # one cbatch request body per choice, in choice order
    prompt_of_choice: list[int]  # which prompt each choice completes (a completions prompt list)
    is_stream: bool
    include_usage: bool
    top_logprobs: int | None  # alternatives per token asked for; None = no logprobs


def _message(i: int, message) -> dict:
    """An OpenAI chat message as cbatch's {role, content}: text parts are joined,
    `developer` is the system role, `name` and other fields are dropped."""
    if not isinstance(message, dict):
        raise invalid(f"messages[{i}] must be an object")
    role, content = message.get("role"), message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise invalid(f"messages[{i}].content: only text parts are supported")
        content = "".join(str(part.get("text", "")) for part in content)
    return {"role": "system" if role == "developer" else role, "content": "" if content is None else content}


def _grammar_of(response_format) -> str | None:
    """response_format -> GBNF through llama-cpp-python's own JSON-schema converter."""
    from llama_cpp import llama_grammar

    if not isinstance(response_format, dict):
        raise invalid("response_format must be an object")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return llama_grammar.JSON_GBNF
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema must be an object")
        try:
            return llama_grammar.json_schema_to_gbnf(json.dumps(schema))
        except Exception as err:  # the converter raises plain exceptions for schemas it cannot take
            raise invalid(f"response_format.json_schema cannot be converted to a grammar: {err}") from None
    raise invalid(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


def _top_logprobs(kind: str, raw: dict) -> int | None:
    if kind == COMPLETION:  # completions: logprobs: N
        value = raw.get("logprobs")
    else:  # chat: logprobs: true, top_logprobs: N
        is_on = raw.get("logprobs")
        if is_on is not None and not isinstance(is_on, bool):
            raise invalid("logprobs must be true or false")
        value = raw.get("top_logprobs")
        if value is not None and not is_on:
            raise invalid("top_logprobs needs logprobs: true")
        if is_on and value is None:
            value = 0
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    return value


def _check_supported(raw: dict) -> None:
    """OpenAI fields that would change the response and that cbatch does not implement are
    refused, not ignored: a caller (or a router) must not take a response for what it asked."""
    if raw.get("echo"):
        raise invalid("echo is not supported; the response never repeats the prompt")
    if raw.get("best_of") not in (None, 1):
        raise invalid("best_of is not supported; use n for several completions")
    if raw.get("suffix") is not None:
        raise invalid("suffix is not supported: the model completes only after the prompt")


def parse_api_request(kind: str, raw, model_id: str | None) -> ApiRequest:
    """Validate the OpenAI-only parts of a request and build cbatch bodies, one per choice.
    `model` must name `model_id` when both are given."""
    if not isinstance(raw, dict):
        raise invalid("the request body must be a JSON object")
    model = raw.get("model")
    if model_id is not None and model is not None and model != model_id:
        raise CbatchError(NOT_FOUND, f"model {model!r} is not served here; this server serves {model_id!r}")
    body = {name: raw[name] for name in PASSTHROUGH_FIELDS if raw.get(name) is not None}
    # max_completion_tokens is the newer name; a null one leaves max_tokens in force
    max_tokens = next((raw[name] for name in ("max_completion_tokens", "max_tokens") if raw.get(name) is not None),
                      None)
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if raw.get("stop") is not None:
        body["stop"] = raw["stop"]
    if raw.get("response_format") is not None:
        grammar = _grammar_of(raw["response_format"])
        if grammar is not None:
            if "grammar" in body:
                raise invalid("give grammar or response_format, not both")
            body["grammar"] = grammar
    top_logprobs = _top_logprobs(kind, raw)
    if top_logprobs is not None:
        body["logprobs"] = top_logprobs
    is_stream = raw.get("stream") or False
    options = raw.get("stream_options") or {}
    if not isinstance(is_stream, bool) or not isinstance(options, dict):
        raise invalid("stream must be true or false, stream_options an object")
    if kind == CHAT:
        messages = raw.get("messages")
        if not isinstance(messages, list):
            raise invalid("messages must be a list of {role, content} objects")
        prompts = [{"messages": [_message(i, m) for i, m in enumerate(messages)]}]
    else:
        prompt = raw.get("prompt")
        prompt_list = prompt if isinstance(prompt, list) else [prompt]
        if not prompt_list or not all(isinstance(p, str) for p in prompt_list):
            raise invalid("prompt must be a string or a non-empty list of strings")
        prompts = [{"prompt": p} for p in prompt_list]
    _check_supported(raw)
    n = raw.get("n")
    num_choices = len(prompts) * (n if isinstance(n, int) and not isinstance(n, bool) else 1)
    if num_choices > MAX_CHOICES_PER_REQUEST:
        raise invalid(f"the request asks for {num_choices} completions (prompts x n); at most "
                      f"{MAX_CHOICES_PER_REQUEST} per request: split it, or use a batch file")
    bodies, prompt_of_choice = [], []
    for i, prompt_body in enumerate(prompts):
        choices = expand_choices({**body, **prompt_body, **({"n": n} if n is not None else {})})
        bodies += choices
        prompt_of_choice += [i] * len(choices)
    return ApiRequest(kind, bodies, prompt_of_choice, is_stream, bool(options.get("include_usage")), top_logprobs)


class ResponseBuilder:
    """OpenAI response objects for one API request: whole responses and stream chunks."""

    def __init__(self, request: ApiRequest, model_id: str):
        self.request = request
        self.model_id = model_id
        prefix = "chatcmpl-" if request.kind == CHAT else "cmpl-"
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if request.kind == CHAT else "text_completion"
        self._text_offsets = [0] * len(request.bodies)  # completions logprobs: offset of the next token

    def usage(self, usages: list[dict | None]) -> dict:
        """Prompt tokens once per prompt (its choices share it), completion tokens summed."""
        prompt_tokens, seen = 0, set()
        for choice, usage in enumerate(usages):
            prompt = self.request.prompt_of_choice[choice]
            if usage and prompt not in seen:
                seen.add(prompt)
                prompt_tokens += usage["prompt_tokens"]
        completion_tokens = sum(u["completion_tokens"] for u in usages if u)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

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
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id, "choices": choices,
                **extra}

    def whole(self, texts: list[str], finish_reasons: list[str], logprobs: list, usages: list[dict]) -> dict:
        choices = []
        for i, (text, reason, lp) in enumerate(zip(texts, finish_reasons, logprobs)):
            choice = {"index": i, "finish_reason": reason, "logprobs": lp}
            if self.request.kind == CHAT:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return self._envelope(self.object, choices, usage=self.usage(usages))

    def chunk(self, choice: int, text: str, finish_reason: str | None, logprobs, is_first: bool) -> dict:
        if self.request.kind == CHAT:
            delta = {"role": "assistant", "content": text} if is_first else ({"content": text} if text else {})
            entry = {"index": choice, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
            obj = "chat.completion.chunk"
        else:
            entry = {"index": choice, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
            obj = "text_completion"
        extra = {"usage": None} if self.request.include_usage else {}
        return self._envelope(obj, [entry], **extra)

    def usage_chunk(self, usages: list[dict | None]) -> dict:
        obj = "chat.completion.chunk" if self.request.kind == CHAT else "text_completion"
        return self._envelope(obj, [], usage=self.usage(usages))


def _merge_logprobs(kind: str, parts: list | None):
    if parts is None:
        return None
    if kind == CHAT:
        return {"content": [e for p in parts for e in p["content"]]}
    return {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


class WholeResponse:
    """One API request's chunks gathered choice by choice into its non-streamed response."""

    def __init__(self, builder: ResponseBuilder):
        self.builder = builder
        num = len(builder.request.bodies)
        self._texts: list[list[str]] = [[] for _ in range(num)]
        self._reasons: list[str | None] = [None] * num
        self._logprobs = [[] if builder.request.top_logprobs is not None else None for _ in range(num)]
        self.usages: list[dict | None] = [None] * num
        self.num_left = num

    def add(self, choice: int, chunk) -> None:
        self._texts[choice].append(chunk.text)
        entries = self.builder.logprobs(choice, getattr(chunk, "logprobs", None))
        if entries is not None:
            self._logprobs[choice].append(entries)
        if chunk.finish_reason:
            self._reasons[choice], self.usages[choice] = chunk.finish_reason, chunk.usage
            self.num_left -= 1

    def response(self) -> dict:
        kind = self.builder.request.kind
        return self.builder.whole(["".join(t) for t in self._texts], self._reasons,
                                  [_merge_logprobs(kind, p) for p in self._logprobs], self.usages)
