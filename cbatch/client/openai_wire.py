"""cbatch request bodies as OpenAI HTTP requests, and OpenAI responses as cbatch chunks:
what a batch sent to an OpenAI-compatible endpoint (a router, a daemon's --http, another
server) needs, so that its result lines read as if a daemon had been asked directly.

cbatch's parameter names are OpenAI's (max_tokens, temperature, top_p, stop, seed, ...);
its extras (top_k, min_p, repeat_penalty, ignore_eos, min_tokens, grammar) go as the extra
fields cbatch's own server, llama-server and vLLM take. Only `logprobs` differs for chat.
"""

import cbatch.errors as errors
from cbatch.client.streams import Chunk
from cbatch.errors import INTERNAL, INVALID_REQUEST, NOT_FOUND, QUEUE_FULL, UNAUTHORIZED, UNAVAILABLE, CbatchError

COMPLETIONS_PATH, CHAT_PATH = "/completions", "/chat/completions"
# An error body's `code` is kept when it is one of cbatch's; anything else is named by status.
KNOWN_CODES = frozenset(value for name, value in vars(errors).items() if name.isupper() and isinstance(value, str))
_CODE_OF_STATUS = {400: INVALID_REQUEST, 401: UNAUTHORIZED, 403: UNAUTHORIZED, 404: NOT_FOUND, 422: INVALID_REQUEST,
                   429: QUEUE_FULL, 502: UNAVAILABLE, 503: UNAVAILABLE, 504: UNAVAILABLE}


def http_request(body: dict, model: str | None) -> tuple[str, dict]:
    """(path under the base URL, JSON payload) of one cbatch request body (one choice)."""
    payload = dict(body)
    if model is not None:
        payload.setdefault("model", model)
    if "messages" not in payload:
        return COMPLETIONS_PATH, payload
    top_logprobs = payload.pop("logprobs", None)
    if top_logprobs is not None:
        payload.update(logprobs=True, top_logprobs=top_logprobs)
    return CHAT_PATH, payload


def _entry(token: str, logprob: float, top: list[dict]) -> dict:
    return {"token": token, "bytes": list(token.encode("utf-8")), "logprob": logprob, "top_logprobs": top}


def _logprobs(path: str, logprobs) -> list[dict] | None:
    """A choice's logprobs in Chunk.logprobs' shape. Chat's already are; completions'
    parallel lists are zipped (bytes are then the token text's, as the server gave it)."""
    if logprobs is None:
        return None
    if path == CHAT_PATH:
        return [{**entry, "top_logprobs": entry.get("top_logprobs") or []} for entry in logprobs.get("content") or []]
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    return [_entry(token, logprob, [_entry(t, lp, []) for t, lp in (top or {}).items()])
            for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops)]


def chunk_from_response(label, path: str, response: dict) -> Chunk:
    """The one, final chunk of a non-streamed response with one choice."""
    try:
        choice = response["choices"][0]
        text = choice["text"] if path == COMPLETIONS_PATH else choice["message"]["content"]
        usage = {name: response["usage"][name] for name in ("prompt_tokens", "completion_tokens")}
        usage["cached_tokens"] = (response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        message = {} if path == COMPLETIONS_PATH else choice["message"]
        # A server that splits thinking says so by the key, even when there was none (null):
        # "" then keeps the answer from being split again.
        reasoning = (message["reasoning_content"] or "") if "reasoning_content" in message else None
        return Chunk(label, text or "", [], choice["finish_reason"], usage, _logprobs(path, choice.get("logprobs")),
                     message.get("tool_calls"), reasoning)
    except (KeyError, IndexError, TypeError) as err:
        raise CbatchError(INTERNAL, f"the server's response is not an OpenAI completion ({err!r} missing)") from None


def error_from_response(status: int, text: str, payload) -> CbatchError:
    """An HTTP error as a CbatchError: the body's code when it is cbatch's, else the status's."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, str):  # some servers send {"error": "message"}
        error = {"message": error}
    if not isinstance(error, dict):
        error = {"message": text.strip()[:500] or f"HTTP {status}"}
    code = error.get("code") if error.get("code") in KNOWN_CODES else _CODE_OF_STATUS.get(status, INTERNAL)
    return CbatchError(code, str(error.get("message") or f"HTTP {status}"))
