"""OpenAI request bodies mapped onto cbatch's, and cbatch's errors into OpenAI's shape
(the responses are built in completions_output.py and responses_output.py).

Used by the HTTP server and by cbatch-submit's OpenAI batch files, so both accept the
same fields. Fields cbatch knows are passed to the daemon, which validates them (a bad
value is an `invalid_request`, HTTP 400); unknown fields are ignored as OpenAI does.
"""

import base64
import re
from dataclasses import dataclass

from cbatch.constraints import strict_objects
from cbatch.embeddings import parse_dimensions, parse_inputs, vector_list
from cbatch.errors import (
    DEADLINE_EXCEEDED,
    DECODE_FAILED,
    FORBIDDEN,
    INTERNAL,
    INVALID_REQUEST,
    MODEL_EMBEDS_ONLY,
    NOT_FOUND,
    PROMPT_TOO_LONG,
    QUEUE_FULL,
    RATE_LIMITED,
    SHUTTING_DOWN,
    TOO_LARGE,
    UNAUTHORIZED,
    UNAVAILABLE,
    WORKER_RESTARTED,
    CbatchError,
)
from cbatch.openai.billing_header import strip_billing_header
from cbatch.openai.choices import expand_choices
from cbatch.openai.image_parts import take_images
from cbatch.openai.reasoning import reasoning_fields
from cbatch.params import MAX_TOP_LOGPROBS, invalid
from cbatch.tools import TOOL_FIELDS, JsonAnswer, ToolPlan, prepare_chat

CHAT, COMPLETION = "chat", "completion"
RETRY_AFTER_S = 1  # what a 429 tells the caller to wait
# Completions (prompts x n) one request may ask for: each is a request of its own in the
# daemon's queue, and more than this is a batch job, for a batch file.
MAX_CHOICES_PER_REQUEST = 256
# OpenAI fields with the same name and meaning in cbatch's request body.
PASSTHROUGH_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                      "repeat_penalty", "seed", "ignore_eos", "min_tokens", "logit_bias", "grammar", "json_schema",
                      "priority", "timeout")
ANY_JSON_OBJECT = {"type": "object"}  # response_format json_object
# cbatch error code -> (HTTP status, OpenAI error type)
_STATUS = {code: status for codes, status in (
    ((INVALID_REQUEST, PROMPT_TOO_LONG, MODEL_EMBEDS_ONLY), (400, "invalid_request_error")),
    ((NOT_FOUND,), (404, "invalid_request_error")),
    ((TOO_LARGE,), (413, "invalid_request_error")),
    ((DEADLINE_EXCEEDED,), (408, "timeout_error")),
    ((UNAUTHORIZED,), (401, "authentication_error")),
    ((FORBIDDEN,), (403, "permission_error")),
    ((QUEUE_FULL, RATE_LIMITED), (429, "rate_limit_error")),
    ((SHUTTING_DOWN, UNAVAILABLE, WORKER_RESTARTED), (503, "service_unavailable")),
    ((DECODE_FAILED, INTERNAL), (500, "server_error")),
) for code in codes}
_LEADING_NAME = re.compile(r"^([a-z_]+)")


def error_status(code: str) -> int:
    return _STATUS.get(code, (500, "server_error"))[0]


def error_body(err: CbatchError, param: str | None = None) -> dict:
    """OpenAI's error shape with cbatch's stable code. `param` is the field at fault: the
    daemon's messages start with the field's name."""
    if param is None:
        name = _LEADING_NAME.match(err.message)
        known = PASSTHROUGH_FIELDS + ("max_tokens", "stop", "prompt", "messages", "n", "logprobs", "top_logprobs",
                                      "model", "tools", "tool_choice", "parallel_tool_calls", "reasoning_budget",
                                      "reasoning_effort", "input", "instructions", "max_output_tokens",
                                      "previous_response_id", "reasoning", "background", "text", "dimensions",
                                      "encoding_format", "response_format", "images")
        param = name.group(1) if name and name.group(1) in known else None
    return {"error": {"message": err.message, "type": _STATUS.get(err.code, (500, "server_error"))[1],
                      "param": param, "code": err.code}}


@dataclass
class ApiRequest:
    kind: str  # CHAT or COMPLETION
    model: str  # the served name the request asked for, echoed in the response
    bodies: list[dict]  # one cbatch request body per choice, in choice order
    prompt_of_choice: list[int]  # which prompt each choice completes (a completions prompt list)
    is_stream: bool
    include_usage: bool
    top_logprobs: int | None  # alternatives per token asked for; None = no logprobs
    tools: ToolPlan | None = None  # chat: the tools offered to the model
    reasoning: dict | None = None  # chat: the tags the model thinks in, split from the answer (reasoning.py)
    schema_field: str | None = None  # the field the caller sent its schema in (response_format, text, ...)
    headers: dict | None = None  # the response's own headers (the HTTP server's notes on the request)

    def param_of(self, err: CbatchError) -> str | None:
        """The field an error about the request's schema names: the one the caller sent
        (the daemon's messages name cbatch's own, json_schema); None for other errors."""
        return self.schema_field if self.schema_field and err.message.startswith("json_schema") else None


def lenient(schema: dict) -> dict:
    """A schema sent without OpenAI's `strict`: keywords llguidance does not enforce (as
    `uniqueItems`, which pydantic and zod write freely) are accepted and left unenforced,
    not refused; the schema's own `x-guidance` may say otherwise."""
    options = schema.get("x-guidance")
    return {**schema, "x-guidance": {"lenient": True, **(options if isinstance(options, dict) else {})}}


def _constraint_of(response_format) -> dict:
    """response_format as cbatch's field: the JSON schema itself, compiled by the decode
    worker (nothing is converted here, so a client-only install sends schemas too)."""
    if not isinstance(response_format, dict):
        raise invalid("response_format must be an object")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return {}
    if kind == "json_object":  # with a `schema` beside it (instructor's JSON_SCHEMA mode), that schema
        schema = response_format.get("schema", ANY_JSON_OBJECT)
        if not isinstance(schema, dict):
            raise invalid("response_format.schema must be an object")
        return {"json_schema": lenient(schema)}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema must be an object")
        return {"json_schema": strict_objects(schema) if spec.get("strict") is True else lenient(schema)}
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
    name = "logprobs" if kind == COMPLETION else "top_logprobs"
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}]")
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


def check_model(model, model_names: list[str]) -> str:
    """The served name a request's `model` gives (the first name when it gives none); any
    other name is a 404 naming what is served, over HTTP and in batch files alike."""
    if model is None:
        return model_names[0]
    if model not in model_names:
        served = ", ".join(repr(name) for name in model_names)
        raise CbatchError(NOT_FOUND, f"model {model!r} is not served here; this server serves {served}")
    return model


def parse_api_request(kind: str, raw, model_names: list[str], reasoning: dict | None = None, *,
                      tool_format: JsonAnswer | None = None, forwards_tools: bool = False,
                      keeps_billing_header: bool = False) -> ApiRequest:
    """Validate the OpenAI-only parts of a request and build cbatch bodies, one per choice.
    `model`, when given, must be one of `model_names`; `reasoning` is the model's thinking
    tags (None: its answers are left as they are); `tool_format` is the call format the model's
    chat template teaches when it knows tools (cbatch.tools.format_of): the daemon then
    renders a chat's tools and tool turns with that template. With
    `forwards_tools` (bodies bound for another OpenAI server) a chat's messages and tools
    stay as they are: that server renders them and reads the calls. Claude Code's billing
    line leaves the system prompt unless `keeps_billing_header` (billing_header.py)."""
    if not isinstance(raw, dict):
        raise invalid("the request body must be a JSON object")
    model = check_model(raw.get("model"), model_names)
    body, top_logprobs = _sampling_body(kind, raw)
    is_stream = raw.get("stream") or False
    options = raw.get("stream_options") or {}
    if not isinstance(is_stream, bool) or not isinstance(options, dict):
        raise invalid("stream must be true or false, stream_options an object")
    tools = None
    if kind == CHAT:
        body.update(reasoning_fields(raw.get("reasoning_budget"), raw.get("reasoning_effort"), reasoning))
        body, tools = _chat_body(raw, body, tool_format, forwards_tools, keeps_billing_header)
        prompts = [{name: body.pop(name) for name in ("messages", "prompt") if name in body}]
    else:
        prompt = raw.get("prompt")
        prompt_list = prompt if isinstance(prompt, list) else [prompt]
        if not prompt_list or not all(isinstance(p, str) for p in prompt_list):
            raise invalid("prompt must be a string or a non-empty list of strings")
        prompts = [{"prompt": p} for p in prompt_list]
    _check_supported(raw)
    bodies, prompt_of_choice = _choices(body, prompts, raw.get("n"))
    return ApiRequest(kind, model, bodies, prompt_of_choice, is_stream, bool(options.get("include_usage")),
                      top_logprobs, tools, reasoning if kind == CHAT else None,
                      "response_format" if raw.get("response_format") is not None else None)


def _sampling_body(kind: str, raw: dict) -> tuple[dict, int | None]:
    """(cbatch's sampling fields of the request, its top_logprobs or None)."""
    body = {name: raw[name] for name in PASSTHROUGH_FIELDS if raw.get(name) is not None}
    # max_completion_tokens is the newer name; a null one leaves max_tokens in force
    max_tokens = next((raw[name] for name in ("max_completion_tokens", "max_tokens") if raw.get(name) is not None),
                      None)
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if raw.get("stop") is not None:
        body["stop"] = raw["stop"]
    if raw.get("response_format") is not None:
        constraint = _constraint_of(raw["response_format"])
        if constraint and ("grammar" in body or "json_schema" in body):
            raise invalid("give grammar, json_schema or response_format, not two of them")
        body.update(constraint)
    top_logprobs = _top_logprobs(kind, raw)
    if top_logprobs is not None:
        body["logprobs"] = top_logprobs
    return body, top_logprobs


def _chat_body(raw: dict, body: dict, tool_format: JsonAnswer | None, forwards_tools: bool,
               keeps_billing_header: bool) -> tuple[dict, ToolPlan | None]:
    """The body with the chat's messages (and tools, for the daemon's template) and images,
    and the tool plan that reads its answers."""
    messages = raw.get("messages") if keeps_billing_header else strip_billing_header(raw.get("messages"))
    chat = {"messages": messages, **{name: raw[name] for name in TOOL_FIELDS if name in raw}}
    if forwards_tools:  # bound for a server that renders them and reads the calls itself
        return {**body, **chat}, None
    chat["messages"], images = take_images(chat["messages"])  # image parts: cbatch's images, a marker each
    return prepare_chat({**body, **chat, **({"images": images} if images else {})}, tool_format)


def _choices(body: dict, prompts: list[dict], n) -> tuple[list[dict], list[int]]:
    """(a cbatch body per choice, the index of the prompt each answers)."""
    num_choices = len(prompts) * (n if isinstance(n, int) and not isinstance(n, bool) else 1)
    if num_choices > MAX_CHOICES_PER_REQUEST:
        raise invalid(f"the request asks for {num_choices} completions (prompts x n); at most "
                      f"{MAX_CHOICES_PER_REQUEST} per request: split it, or use a batch file")
    bodies, prompt_of_choice = [], []
    for i, prompt_body in enumerate(prompts):
        choices = expand_choices({**body, **prompt_body, **({"n": n} if n is not None else {})})
        bodies += choices
        prompt_of_choice += [i] * len(choices)
    return bodies, prompt_of_choice


@dataclass
class EmbeddingRequest:
    model: str  # the served name the request asked for, echoed in the response
    inputs: list  # strings and token-id lists
    is_base64: bool  # encoding_format "base64": each vector as base64 of its float32 little-endian bytes
    dimensions: int | None  # None, or the model's own size (the daemon refuses any other)


def parse_embedding_request(raw, model_names: list[str]) -> EmbeddingRequest:
    """An OpenAI embeddings body; `model`, when given, must be one of `model_names`."""
    if not isinstance(raw, dict):
        raise invalid("the request body must be a JSON object")
    model = check_model(raw.get("model"), model_names)
    if "input" not in raw:
        raise invalid("input is required: a string or a list of strings or token-id lists")
    encoding_format = raw.get("encoding_format") or "float"
    if encoding_format not in ("float", "base64"):
        raise invalid(f"encoding_format must be float or base64, got {encoding_format!r}")
    return EmbeddingRequest(model, parse_inputs(raw["input"]), encoding_format == "base64",
                            parse_dimensions(raw.get("dimensions")))


def embedding_response(request: EmbeddingRequest, vectors: list[bytes], prompt_tokens: int) -> dict:
    """OpenAI's embeddings response (vectors as float32 little-endian bytes)."""
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(vector).decode() if request.is_base64 else vector_list(vector)}
            for i, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": request.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
