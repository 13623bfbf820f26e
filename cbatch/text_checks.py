"""The checks every piece of a caller's text passes where a request is read: a string, not
empty unless allowed, within its length, and encodable as UTF-8 (json.loads lets a lone
surrogate through, which a str type accepts and every encoder after it refuses)."""

from cbatch.errors import INVALID_REQUEST, CbatchError

MAX_PROMPT_CHARS = 1 << 20  # of a prompt, or of one message's content


def invalid(message: str) -> CbatchError:
    """The error of a request that cannot run as given (400 over HTTP)."""
    return CbatchError(INVALID_REQUEST, message)


def checked_text(name: str, value, max_chars: int, *, allow_empty: bool = False) -> str:
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
