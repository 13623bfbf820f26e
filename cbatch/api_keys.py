"""The API keys file (`cbatch-worker --api-keys-file PATH`): one key a line,

    NAME KEY [weight=W] [max_concurrent=N] [tokens_per_min=N] [metrics=1]

NAME is the tenant the key's requests run as: the scheduler shares decode steps among
tenants by weight, and the front-end holds each to its limits (0 or absent: no limit).
`metrics=1` lets the key read /metrics, which shows every tenant's usage: an operator's
(or a Prometheus scraper's) key, where a tenant's key gets 403 forbidden there.
`#` starts a comment; blank lines are skipped. A line that cannot be read is an
INVALID_CONFIG error naming the file and line, and nothing of the file is used then: the
daemon refuses to start, and a reload (SIGHUP) keeps the keys it had.

Shared by the HTTP servers (which key is which tenant) and the front-end (weights and
limits), each of which reads the file itself, on start and on SIGHUP.
"""

import hmac
import re
from dataclasses import dataclass

from cbatch.errors import INVALID_CONFIG, CbatchError

DEFAULT_TENANT = "default"  # the tenant of a request that names none (a native client, a single --api-key)
TENANT_PATTERN = r"\A[A-Za-z0-9_.-]{1,64}\Z"  # fits a metrics label and a log line as it is
TENANT_NAME = re.compile(TENANT_PATTERN)
MAX_WEIGHT = 1e6
MAX_LIMIT = 1 << 40


@dataclass(frozen=True)
class TenantKey:
    name: str
    key: str
    weight: float = 1.0
    max_concurrent: int = 0  # requests in flight at once; 0 = no limit
    tokens_per_min: int = 0  # prompt + generated tokens a minute, refilled continuously; 0 = no limit
    metrics: bool = False  # may read /metrics (every tenant's names and usage)


def is_tenant_name(value) -> bool:
    return isinstance(value, str) and TENANT_NAME.match(value) is not None


def _option(where: str, word: str) -> tuple[str, float | int | bool]:
    name, is_pair, value = word.partition("=")
    if not is_pair or name not in ("weight", "max_concurrent", "tokens_per_min", "metrics"):
        raise CbatchError(INVALID_CONFIG, f"{where}: unknown option {word!r}; expected weight=W, max_concurrent=N, "
                                          "tokens_per_min=N or metrics=1")
    if name == "metrics":
        if value not in ("0", "1"):
            raise CbatchError(INVALID_CONFIG, f"{where}: metrics must be 0 or 1, got {value!r}")
        return name, value == "1"
    try:
        number = float(value) if name == "weight" else int(value)
    except ValueError:
        number = -1
    if name == "weight" and not 0 < number <= MAX_WEIGHT:
        raise CbatchError(INVALID_CONFIG, f"{where}: weight must be a number in (0, {MAX_WEIGHT:g}], got {value!r}")
    if name != "weight" and not 0 <= number <= MAX_LIMIT:
        raise CbatchError(INVALID_CONFIG, f"{where}: {name} must be a whole number >= 0, got {value!r}")
    return name, number


def parse_keys(text: str, source: str) -> dict[str, TenantKey]:
    """The keys of a keys file's text, by tenant name; CbatchError(INVALID_CONFIG) names
    `source` and the line of the first problem."""
    keys: dict[str, TenantKey] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source} line {number}"
        if len(words) < 2:
            raise CbatchError(INVALID_CONFIG, f"{where}: expected 'NAME KEY [weight=W] [max_concurrent=N] "
                                              "[tokens_per_min=N] [metrics=1]'")
        name, key = words[0], words[1]
        if not is_tenant_name(name):
            raise CbatchError(INVALID_CONFIG, f"{where}: the name {name!r} must be 1 to 64 letters, digits, '_', '.' "
                                              "or '-'")
        if name in keys:
            raise CbatchError(INVALID_CONFIG, f"{where}: the name {name!r} is given twice")
        if "=" in key:
            raise CbatchError(INVALID_CONFIG, f"{where}: the key is missing (options come after NAME KEY)")
        if any(other.key == key for other in keys.values()):
            raise CbatchError(INVALID_CONFIG, f"{where}: {name!r} has another tenant's key; each tenant needs its own")
        keys[name] = TenantKey(name, key, **dict(_option(where, word) for word in words[2:]))
    return keys


def load_keys(path: str) -> dict[str, TenantKey]:
    try:
        with open(path, encoding="utf-8") as keys_file:
            text = keys_file.read()
    except OSError as err:
        raise CbatchError(INVALID_CONFIG, f"cannot read --api-keys-file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise CbatchError(INVALID_CONFIG, f"--api-keys-file {path} is not UTF-8 text") from None
    return parse_keys(text, path)


def tenant_of_key(keys: dict[str, TenantKey], given: bytes) -> str | None:
    """The tenant whose key `given` is, or None. Every key is compared, in constant time
    each, so how long it takes tells nothing of which key came close."""
    found = None
    for tenant in keys.values():
        if hmac.compare_digest(given, tenant.key.encode()):
            found = tenant.name
    return found
