"""The API key check, as llama-server's and vLLM's `--api-key`: every request but
/health must carry `Authorization: Bearer KEY`. /health stays open: it tells a router or
a probe only whether the daemon serves, and they check it without credentials."""

import hmac

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from cbatch.errors import CbatchError, UNAUTHORIZED
from cbatch.http_api.openai_mapping import error_body
from cbatch.http_api.state import json_response

API_KEY_ENV = "CBATCH_API_KEY"  # how the daemon hands the key to its HTTP processes (not argv: ps shows it)
OPEN_PATHS = ("/health",)


class RequireApiKey:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):  # constant time: no key guessing by timing
                await _unauthorized()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _unauthorized() -> Response:
    err = CbatchError(UNAUTHORIZED, "a valid API key is needed: send 'Authorization: Bearer <key>'")
    return json_response(error_body(err), 401, {"WWW-Authenticate": "Bearer"})
