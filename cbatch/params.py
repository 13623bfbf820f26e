"""Per-request parameters: the schema, its defaults, and validation done once at the edge.

Everything a caller sends is checked here (type, range, unknown fields) before it can
reach a queue, so the decode loop only ever sees well-formed requests.
"""

import math
from dataclasses import dataclass, field, fields

from cbatch.api_keys import DEFAULT_TENANT, MAX_WEIGHT, is_tenant_name
from cbatch.constraints import check_grammar, check_json_schema
from cbatch.errors import INVALID_REQUEST, CbatchError
from cbatch.images import check_images

CHAT_ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_PROMPT_CHARS = 1 << 20
MAX_MESSAGES = 1024
MAX_TOKENS_LIMIT = 1 << 20
MAX_SEED = 0xFFFFFFFE  # 0xFFFFFFFF is llama.cpp's "pick a random seed"
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIASES = 1024  # token ids one request may bias
MAX_LOGIT_BIAS = 100.0  # as OpenAI: -100 bans a token in practice, +100 all but forces it
INTERACTIVE, BATCH = "interactive", "batch"
PRIORITIES = (INTERACTIVE, BATCH)  # admission order: every waiting interactive request before any batch one
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = disabled
    top_p: float = 0.95  # 1 = disabled
    min_p: float = 0.05  # 0 = disabled
    repeat_penalty: float = 1.0  # 1 = disabled
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1 = random
    stop: tuple[str, ...] = ()
    grammar: str | None = None  # GBNF, or llguidance's Lark when it starts with %llguidance
    json_schema: str | None = None  # a JSON schema as compact JSON text (its keys in the caller's order)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; K = the chosen token's and the K most likely tokens'
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); ids checked by the engine
    min_tokens: int = 0  # end-of-generation tokens are suppressed until this many were generated
    # Thinking in tags: after this many tokens inside the (open, close) block without its
    # close tag, the close tag's tokens are forced (workers/engine/sampling/budget.py).
    reasoning_budget: int | None = None
    reasoning_tags: tuple[str, str] | None = None

    @property
    def has_constraint(self) -> bool:
        return self.grammar is not None or self.json_schema is not None

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


@dataclass(frozen=True)
class Request:
    """A validated request: exactly one of `prompt` or `messages`."""

    request_id: int
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: str = INTERACTIVE
    timeout_s: float | None = None  # seconds from its arrival at the daemon; None = the daemon's default
    # Whose request it is (the HTTP server sets it from the API key) and that tenant's
    # share of the decode steps, which the front-end sets from the keys file.
    tenant: str = DEFAULT_TENANT
    tenant_weight: float = 1.0
    images: tuple[bytes, ...] = ()  # image files (PNG, JPEG, ...), one per IMAGE_MARKER in order


def invalid(message: str) -> CbatchError:
    """The error of a request that cannot run as given (400 over HTTP)."""
    return CbatchError(INVALID_REQUEST, message)


def _int(name, value, lo, hi):
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise invalid(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _float(name, value, lo, hi, *, lo_open=False):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise invalid(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise invalid(f"{name} must be in {bracket}{lo}, {hi}], got {value}")
    return value


def _bool(name, value):
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {type(value).__name__}")
    return value


def _text(name, value, max_chars, *, allow_empty=False):
    if not isinstance(value, str):
        raise invalid(f"{name} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise invalid(f"{name} must not be empty")
    if len(value) > max_chars:
        raise invalid(f"{name} is longer than {max_chars} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{name} is not valid UTF-8 (lone surrogate)") from None
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
    return tuple(_text("stop[]", s, MAX_STOP_CHARS) for s in value)


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
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise invalid("reasoning_tags must be [open tag, close tag]")
    return tuple(_text("reasoning_tags[]", tag, MAX_STOP_CHARS) for tag in value)


_PARAM_CHECKS = {
    "max_tokens": lambda v: _int("max_tokens", v, 1, MAX_TOKENS_LIMIT),
    "temperature": lambda v: _float("temperature", v, 0.0, 100.0),
    "top_k": lambda v: _int("top_k", v, 0, 1 << 20),
    "top_p": lambda v: _float("top_p", v, 0.0, 1.0, lo_open=True),
    "min_p": lambda v: _float("min_p", v, 0.0, 1.0),
    "repeat_penalty": lambda v: _float("repeat_penalty", v, 0.0, 10.0, lo_open=True),
    "presence_penalty": lambda v: _float("presence_penalty", v, -2.0, 2.0),
    "frequency_penalty": lambda v: _float("frequency_penalty", v, -2.0, 2.0),
    "seed": lambda v: _int("seed", v, -1, MAX_SEED),
    "stop": _stop,
    "grammar": check_grammar,
    "json_schema": check_json_schema,
    "ignore_eos": lambda v: _bool("ignore_eos", v),
    "logprobs": lambda v: None if v is None else _int("logprobs", v, 0, MAX_TOP_LOGPROBS),
    "logit_bias": _logit_bias,
    "min_tokens": lambda v: _int("min_tokens", v, 0, MAX_TOKENS_LIMIT),
    "reasoning_budget": lambda v: None if v is None else _int("reasoning_budget", v, 0, MAX_TOKENS_LIMIT),
    "reasoning_tags": lambda v: None if v is None else _reasoning_tags(v),
}
PARAM_NAMES = frozenset(_PARAM_CHECKS)
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def parse_params(raw: dict) -> SamplingParams:
    _keys_are_strings("parameter", raw)
    unknown = sorted(set(raw) - PARAM_NAMES)
    if unknown:
        raise invalid(f"unknown parameter(s) {unknown}; known: {sorted(PARAM_NAMES)}")
    return SamplingParams(**{name: _PARAM_CHECKS[name](value) for name, value in raw.items()})


def _messages(value):
    if not isinstance(value, (list, tuple)) or not value:
        raise invalid("messages must be a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        raise invalid(f"messages takes at most {MAX_MESSAGES} entries")
    parsed = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or len(message) != 2 or set(message) != {"role", "content"}:
            raise invalid(f"messages[{i}] must be an object with exactly 'role' and 'content'")
        role = message["role"]
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}")
        parsed.append((role, _text(f"messages[{i}].content", message["content"], MAX_PROMPT_CHARS, allow_empty=True)))
    return tuple(parsed)


def parse_request(request_id: int, raw: dict) -> Request:
    """Validate one request body: `prompt` or `messages`, plus any sampling parameter."""
    if not isinstance(raw, dict):
        raise invalid("a request must be an object")
    _keys_are_strings("request", raw)
    body = dict(raw)
    prompt, messages = body.pop("prompt", None), body.pop("messages", None)
    if (prompt is None) == (messages is None):
        raise invalid("give exactly one of 'prompt' or 'messages'")
    scheduling = {"priority": priority(body.pop("priority", INTERACTIVE)),
                  "timeout_s": timeout(body.pop("timeout", None)),
                  "tenant": tenant(body.pop("tenant", DEFAULT_TENANT)),
                  "tenant_weight": _float("tenant_weight", body.pop("tenant_weight", 1.0), 0.0, MAX_WEIGHT,
                                          lo_open=True)}
    images = check_images(body.pop("images", None), prompt, messages)
    params = parse_params(body)
    if params.grammar is not None and params.json_schema is not None:
        raise invalid("give grammar or json_schema, not both")
    if params.has_constraint and params.ignore_eos:
        raise invalid("a grammar or json_schema and ignore_eos cannot be combined: a completed constraint allows "
                      "only end-of-generation")
    if prompt is not None:
        return Request(request_id, prompt=_text("prompt", prompt, MAX_PROMPT_CHARS), params=params, images=images,
                       **scheduling)
    return Request(request_id, messages=_messages(messages), params=params, images=images, **scheduling)


def request_fields(request: Request, tenant_weight: float) -> list:
    """A parsed request as plain values in field order, its tenant's weight set: how the
    front-end hands it to the decode worker, which rebuilds it (request_from_fields)
    instead of parsing the caller's body a second time."""
    params = request.params
    return [request.prompt, request.messages, [getattr(params, name) for name in _SAMPLING_FIELDS],
            request.priority, request.timeout_s, request.tenant, tenant_weight, list(request.images)]


def request_from_fields(request_id: int, values: list) -> Request:
    """request_fields' values back as the Request, unchecked: they were checked by
    parse_request. msgpack carried its tuples as lists; the tuples come back."""
    prompt, messages, param_values, priority_name, timeout_s, tenant_name, tenant_weight, images = values
    params = dict(zip(_SAMPLING_FIELDS, param_values))
    params["stop"] = tuple(params["stop"])
    params["logit_bias"] = tuple(map(tuple, params["logit_bias"]))
    if params["reasoning_tags"] is not None:
        params["reasoning_tags"] = tuple(params["reasoning_tags"])
    return Request(request_id, prompt, None if messages is None else tuple(map(tuple, messages)),
                   SamplingParams(**params), priority_name, timeout_s, tenant_name, tenant_weight, tuple(images))


def priority(value) -> str:
    if value not in PRIORITIES:
        raise invalid(f"priority must be one of {list(PRIORITIES)}, got {value!r}")
    return value


def tenant(value) -> str:
    if not is_tenant_name(value):
        raise invalid(f"tenant must be 1 to 64 letters, digits, '_', '.' or '-', got {value!r}")
    return value


def timeout(value) -> float | None:
    """Seconds a request may take from its arrival, queued and running; None = the default."""
    return None if value is None else _float("timeout", value, 0.0, MAX_TIMEOUT_S, lo_open=True)


MAX_CHOICES = 16


def expand_choices(body: dict) -> list[dict]:
    """A body asking for `n` completions of one prompt becomes n request bodies, each its
    own sequence and sampler; with a `seed`, the i-th gets `seed + i` (random seeds stay
    random). They are submitted together, so the engine computes the shared prompt once:
    the later ones wait for its blocks (cache-aware admission) and reuse them. Without
    `n`, the body is returned as it is; everything but `n` is checked by the daemon."""
    if not isinstance(body, dict) or "n" not in body:
        return [body]
    rest = dict(body)
    n = _int("n", rest.pop("n"), 1, MAX_CHOICES)
    seed = rest.get("seed", -1)
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
        _int("seed", seed, 0, MAX_SEED - (n - 1))
        return [{**rest, "seed": seed + i} for i in range(n)]
    return [dict(rest) for _ in range(n)]
