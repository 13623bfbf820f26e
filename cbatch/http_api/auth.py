"""The API key check, as llama-server's and vLLM's `--api-key`: every request but
/health must carry `Authorization: Bearer KEY`. /health stays open: it tells a router or
a probe only whether the daemon serves, and they check it without credentials.

With `--api-keys-file` each key names a tenant (cbatch/api_keys.py); the tenant of the
key a request came with goes in the request's scope (TENANT_SCOPE_KEY), for the bodies it
submits and the access log. A single `--api-key` is the tenant "default". The file is
read again on SIGHUP (`reload`): a request already admitted runs on whatever changes.

/metrics is the operator's: it names every tenant and what each was served. With a keys
file only a key marked `metrics=1` may read it (others get 403 forbidden, which tells
nothing but that); the one `--api-key` may, being the operator's own.
"""

import logging

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from cbatch.anthropic.messages_output import anthropic_error_body
from cbatch.api_keys import DEFAULT_TENANT, TenantKey, load_keys, tenant_of_key
from cbatch.errors import FORBIDDEN, INVALID_REQUEST, UNAUTHORIZED, CbatchError
from cbatch.http_api.json_io import json_response
from cbatch.openai.mapping import error_body

API_KEY_ENV = "CBATCH_API_KEY"  # how the daemon hands the key to its HTTP processes (not argv: ps shows it)
API_KEYS_FILE_ENV = "CBATCH_API_KEYS_FILE"  # the keys file's path, read by each HTTP process itself
OPEN_PATHS = ("/health",)
OPERATOR_PATHS = ("/metrics",)  # for keys with metrics=1 only
ANTHROPIC_PATHS = ("/v1/messages",)  # answered in Anthropic's error shape
TENANT_SCOPE_KEY = "cbatch.tenant"
MAX_CONCURRENT_SCOPE_KEY = "cbatch.max_concurrent"  # the key's max_concurrent (0: no limit)
BEARER = b"Bearer "

log = logging.getLogger("cbatch.http")


class ApiKeys:
    """The keys this server accepts: one `--api-key`, or those of a keys file."""

    def __init__(self, api_key: str = "", keys_file: str = ""):
        self.keys_file = keys_file
        self.keys = (load_keys(keys_file) if keys_file
                     else {DEFAULT_TENANT: TenantKey(DEFAULT_TENANT, api_key, metrics=True)})

    def reload(self) -> None:
        """Read the keys file again; a file that cannot be read keeps the keys there were."""
        if not self.keys_file:
            return
        try:
            self.keys = load_keys(self.keys_file)
        except CbatchError as err:
            log.error("cbatch http: keeping the API keys there were: %s", err.message)
            return
        log.info("cbatch http: API keys reloaded: %d tenants", len(self.keys))

    def tenant_of(self, headers: dict[bytes, bytes]) -> str | None:
        """The tenant of the key in `Authorization: Bearer KEY`, or in `x-api-key: KEY` (as
        Anthropic's SDKs send it); None without a valid one."""
        authorization = headers.get(b"authorization", b"")
        if authorization.startswith(BEARER):
            return tenant_of_key(self.keys, authorization[len(BEARER):])
        key = headers.get(b"x-api-key")
        return None if key is None else tenant_of_key(self.keys, key)


class RequireApiKey:
    def __init__(self, app: ASGIApp, api_keys: ApiKeys):
        self.app = app
        self.api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            tenant = self.api_keys.tenant_of(dict(scope["headers"]))
            if tenant is None:
                await _unauthorized(scope["path"])(scope, receive, send)
                return
            if scope["path"] in OPERATOR_PATHS and not self.api_keys.keys[tenant].metrics:
                await _forbidden(scope["path"])(scope, receive, send)
                return
            scope[TENANT_SCOPE_KEY] = tenant
            scope[MAX_CONCURRENT_SCOPE_KEY] = self.api_keys.keys[tenant].max_concurrent
        await self.app(scope, receive, send)


def check_choices_fit(scope: Scope, num_choices: int) -> None:
    """Each choice of a request (n, or a list of prompts) runs as a request of its own, all
    at once: more of them than the key's max_concurrent could never all be admitted, so the
    request is refused as it stands (400) rather than with a 429 that no retry would end."""
    max_concurrent = scope.get(MAX_CONCURRENT_SCOPE_KEY, 0)
    if max_concurrent and num_choices > max_concurrent:
        raise CbatchError(INVALID_REQUEST, f"the request asks for {num_choices} completions at once (n x prompts), "
                                           f"and its API key allows {max_concurrent} in flight (max_concurrent): "
                                           "lower n, or raise the key's max_concurrent in the keys file")


def _unauthorized(path: str) -> Response:
    """Names no tenant: a caller learns nothing of the keys there are."""
    err = CbatchError(UNAUTHORIZED, "a valid API key is needed: send 'Authorization: Bearer <key>' or "
                                    "'x-api-key: <key>'")
    shape = anthropic_error_body if path.startswith(ANTHROPIC_PATHS) else error_body
    return json_response(shape(err), 401, {"WWW-Authenticate": "Bearer"})


def _forbidden(path: str) -> Response:
    err = CbatchError(FORBIDDEN, f"this API key may not read {path}: only a key with metrics=1 in the keys file may")
    return json_response(error_body(err), 403)
