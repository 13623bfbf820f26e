"""Per-request parameters: the schema, its defaults, and validation done once at the edge.

Everything a caller sends is checked here (type, range, unknown fields) before it can
reach a queue, so the decode loop only ever sees well-formed requests.
"""

import reprlib
from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta, structs

from cbatch.api_keys import DEFAULT_TENANT, MAX_WEIGHT, TENANT_PATTERN
from cbatch.chat_messages import ChatMessage, ToolSpec, parse_messages, parse_tools
from cbatch.constraints import check_grammar, check_json_schema, check_tool_call
from cbatch.images import check_images
from cbatch.text_checks import MAX_PROMPT_CHARS, checked_text, invalid

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOKENS_LIMIT = 1 << 20
MAX_SEED = 0xFFFFFFFE  # 0xFFFFFFFF is llama.cpp's "pick a random seed"
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIASES = 1024  # token ids one request may bias
MAX_LOGIT_BIAS = 100.0  # as OpenAI: -100 bans a token in practice, +100 all but forces it
INTERACTIVE, BATCH = "interactive", "batch"
Priority = Literal["interactive", "batch"]
PRIORITIES = get_args(Priority)  # admission order: every waiting interactive request before any batch one
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _ranged(kind: type, lo, hi, *, is_lo_open: bool = False):
    """A number in [lo, hi] ((lo, hi] when is_lo_open); NaN fails the bound, as it must."""
    return Annotated[kind, Meta(gt=lo, le=hi) if is_lo_open else Meta(ge=lo, le=hi)]


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A forced call as it travels (the tool plan makes it, cbatch/tools/plan.py): how the
    model writes calls (cbatch/tools/formats.py), the functions it may call, each with its
    parameter schema as compact JSON text, and whether the answer is one call or several.
    The decode worker builds its grammar (workers/engine/structured/tool_grammar.py)."""

    format: Literal["json_answer", "tagged", "bare_json"]
    functions: tuple[tuple[str, str], ...]  # (name, parameter schema), in the request's order
    arguments_key: Literal["arguments", "parameters"] = "arguments"
    is_one_call: bool = True


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A request's sampling parameters. Its annotated types are the caller's limits, which
    msgspec checks (type and range, in C) as it converts the caller's map; on the way to
    the decode worker a field left at its default is not sent."""

    max_tokens: _ranged(int, 1, MAX_TOKENS_LIMIT) = 256
    temperature: _ranged(float, 0.0, 100.0) = 0.8  # 0 = greedy
    top_k: _ranged(int, 0, 1 << 20) = 40  # 0 = disabled
    top_p: _ranged(float, 0.0, 1.0, is_lo_open=True) = 0.95  # 1 = disabled
    min_p: _ranged(float, 0.0, 1.0) = 0.05  # 0 = disabled
    repeat_penalty: _ranged(float, 0.0, 10.0, is_lo_open=True) = 1.0  # 1 = disabled
    presence_penalty: _ranged(float, -2.0, 2.0) = 0.0
    frequency_penalty: _ranged(float, -2.0, 2.0) = 0.0
    seed: _ranged(int, -1, MAX_SEED) = -1  # -1 = random
    stop: tuple[str, ...] = ()
    grammar: str | None = None  # GBNF, or llguidance's Lark when it starts with %llguidance
    json_schema: str | None = None  # a JSON schema as compact JSON text (its keys in the caller's order)
    tool_call: ToolCall | None = None  # the answer is a call of one of these functions
    ignore_eos: bool = False
    logprobs: _ranged(int, 0, MAX_TOP_LOGPROBS) | None = None  # None = none; K = the chosen and K most likely
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); ids checked by the engine
    min_tokens: _ranged(int, 0, MAX_TOKENS_LIMIT) = 0  # end-of-generation tokens are suppressed until then
    # Thinking in tags: after this many tokens inside the (open, close) block without its
    # close tag, the close tag's tokens are forced (workers/engine/thinking/budget.py).
    reasoning_budget: _ranged(int, 0, MAX_TOKENS_LIMIT) | None = None
    reasoning_tags: tuple[str, str] | None = None

    @property
    def has_constraint(self) -> bool:
        return self.grammar is not None or self.json_schema is not None or self.tool_call is not None

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing that needs llama.cpp's sampler chain: a plain argmax (a
        constraint checks and masks that argmax, and needs no chain)."""
        return (
            self.temperature == 0.0
            and self.repeat_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and not self.logit_bias
            and self.min_tokens == 0
        )


class Scheduling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When a request is admitted and how long it may take, and whose it is: a request's
    fields of the same names (`timeout` as the caller writes it), bounds checked by msgspec."""

    priority: Priority = INTERACTIVE
    timeout_s: _ranged(float, 0.0, MAX_TIMEOUT_S, is_lo_open=True) | None = msgspec.field(default=None, name="timeout")
    tenant: Annotated[str, Meta(pattern=TENANT_PATTERN)] = DEFAULT_TENANT
    tenant_weight: _ranged(float, 0.0, MAX_WEIGHT, is_lo_open=True) = 1.0


class Request(msgspec.Struct, frozen=True, array_like=True):
    """A validated request: exactly one of `prompt` or `messages`. The one shape a request
    has from the front-end, which parses the caller's map into it, to the decode worker,
    which decodes it from the front-end's message (workers/messages.py: WorkerSubmit).
    On that wire it is an array of its fields in order, the request id first."""

    request_id: int
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None  # cbatch/chat_messages.py: rendered by the decode worker
    params: SamplingParams = SamplingParams()
    priority: Priority = INTERACTIVE
    timeout_s: float | None = None  # seconds from its arrival at the daemon; None = the daemon's default
    # Whose request it is (the HTTP server sets it from the API key) and that tenant's
    # share of the decode steps, which the front-end sets from the keys file.
    tenant: str = DEFAULT_TENANT
    tenant_weight: float = 1.0
    images: tuple[bytes, ...] = ()  # image files (PNG, JPEG, ...), one per IMAGE_MARKER in order
    offered_tools: tuple[ToolSpec, ...] = ()  # the model's chat template describes them (with messages only)


def _float(name, value, lo, hi, *, lo_open=False):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise invalid(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not lo <= value <= hi or (lo_open and value == lo):  # NaN fails both bounds
        bracket = "(" if lo_open else "["
        raise invalid(f"{name} must be in {bracket}{lo}, {hi}], got {value}")
    return value


def _keys_are_strings(name: str, raw: dict) -> None:
    if not all(isinstance(key, str) for key in raw):
        raise invalid(f"{name} keys must be strings")


def _stop(value):
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise invalid("stop must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise invalid(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(value)}")
    return tuple(checked_text("stop[]", s, MAX_STOP_CHARS) for s in value)


def _logit_bias(value):
    """OpenAI's shape: {"token id": bias}, the ids as strings (JSON and msgpack keys)."""
    if not isinstance(value, dict):
        raise invalid("logit_bias must be an object mapping token ids (as strings) to numbers")
    if len(value) > MAX_LOGIT_BIASES:
        raise invalid(f"logit_bias takes at most {MAX_LOGIT_BIASES} token ids, got {len(value)}")
    biases = []
    for key, bias in value.items():
        if not isinstance(key, str) or not (key.isascii() and key.isdigit()):  # "²" is a digit to isdigit
            raise invalid(f"logit_bias keys must be token ids written as decimal strings, got {key!r}")
        biases.append((int(key), _float("logit_bias[]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)))
    return tuple(sorted(biases))


def _reasoning_tags(value):
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise invalid("reasoning_tags must be [open tag, close tag]")
    return tuple(checked_text("reasoning_tags[]", tag, MAX_STOP_CHARS) for tag in value)


# What msgspec cannot say: a caller's shape that differs from the field's (a string or a
# list; an object of ids as strings; a schema object kept as text), and text that must be
# UTF-8 (a lone surrogate passes a str type). These run first; msgspec checks the rest.
_BY_HAND = {"stop": _stop, "grammar": check_grammar, "json_schema": check_json_schema, "tool_call": check_tool_call,
            "logit_bias": _logit_bias, "reasoning_tags": _reasoning_tags}
PARAM_NAMES = frozenset(SamplingParams.__struct_fields__)
SCHEDULING_NAMES = tuple(field.encode_name for field in structs.fields(Scheduling))
DEFAULT_SCHEDULING = Scheduling()  # most requests set none of it: no conversion for them
CONSTRAINT_NAMES = ("grammar", "json_schema", "tool_call")  # at most one a request


# What a refused field of a few values, or of a pattern, must be: said in words, not as
# msgspec's enum or regex.
_MUST_BE = {"priority": f"one of {list(PRIORITIES)}", "tenant": "1 to 64 letters, digits, '_', '.' or '-'"}


def _field_error(err: msgspec.ValidationError, raw: dict) -> str:
    """msgspec's message ("Expected `int` >= 1 - at `$.max_tokens`") led by the field's
    name, and followed by what the caller sent where it says only what it expected; a
    field of a few values, or of a pattern, says what it must be in words."""
    expected, _, path = str(err).rpartition(" - at `$.")
    name = path.rstrip("`")
    if not expected or name not in raw:
        return str(err)
    if name in _MUST_BE and ("enum value" in expected or "matching regex" in expected):
        return f"{name} must be {_MUST_BE[name]}, got {reprlib.repr(raw[name])}"
    said = f"{expected[0].lower()}{expected[1:]}"
    return f"{name}: {said}" if ", got `" in said else f"{name}: {said}, got {reprlib.repr(raw[name])}"


def _converted(raw: dict, struct: type):
    try:
        return msgspec.convert(raw, struct, strict=True)
    except msgspec.ValidationError as err:
        raise invalid(_field_error(err, raw)) from None


def parse_params(raw: dict) -> SamplingParams:
    _keys_are_strings("parameter", raw)
    unknown = sorted(set(raw) - PARAM_NAMES)
    if unknown:
        raise invalid(f"unknown parameter(s) {unknown}; known: {sorted(PARAM_NAMES)}")
    return _converted({name: _BY_HAND[name](value) if name in _BY_HAND else value for name, value in raw.items()},
                      SamplingParams)


def parse_scheduling(raw: dict) -> Scheduling:
    """`priority`, `timeout`, `tenant` and `tenant_weight`, as a caller or the front-end sends them."""
    return _converted(raw, Scheduling)


def parse_request(request_id: int, raw: dict) -> Request:
    """Validate one request body: `prompt` or `messages`, plus any sampling parameter."""
    if not isinstance(raw, dict):
        raise invalid("a request must be an object")
    _keys_are_strings("request", raw)
    body = dict(raw)
    prompt, messages = body.pop("prompt", None), body.pop("messages", None)
    if (prompt is None) == (messages is None):
        raise invalid("give exactly one of 'prompt' or 'messages'")
    when = DEFAULT_SCHEDULING if body.keys().isdisjoint(SCHEDULING_NAMES) else \
        parse_scheduling({name: body.pop(name) for name in SCHEDULING_NAMES if name in body})
    images = check_images(body.pop("images", None), prompt, messages)
    offered_tools = body.pop("offered_tools", None)
    if offered_tools and prompt is not None:
        raise invalid("offered_tools take 'messages', not 'prompt': the model's chat template describes them")
    params = parse_params(body)
    given = [name for name in CONSTRAINT_NAMES if getattr(params, name) is not None]
    if len(given) > 1:
        raise invalid(f"give one of {', '.join(CONSTRAINT_NAMES)}, not {' and '.join(given)}")
    if params.has_constraint and params.ignore_eos:
        raise invalid(f"{given[0]} and ignore_eos cannot be combined: a completed constraint allows only "
                      "end-of-generation")
    if prompt is not None:
        prompt = checked_text("prompt", prompt, MAX_PROMPT_CHARS)
        return Request(request_id, prompt=prompt, params=params, images=images, **structs.asdict(when))
    return Request(request_id, messages=parse_messages(messages), params=params, images=images,
                   offered_tools=parse_tools(offered_tools), **structs.asdict(when))
