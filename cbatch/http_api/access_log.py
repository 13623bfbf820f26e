"""One access-log line per HTTP request: the caller's address and tenant (the API key's
name; "-" without keys, or for a request refused one), method, path, status, the error
code of a request that failed (also one that failed after its stream had started), and
time taken.

A plain ASGI middleware around the whole app, so that every answer is logged alike:
routes, 404/405 for unknown paths, 401 from the API key check. uvicorn's own access log
is off: it knows no error codes and logs a stream when it starts, not when it ends.
"""

import logging
import time

import orjson

from cbatch.http_api.auth import TENANT_SCOPE_KEY

log = logging.getLogger("cbatch.http.access")

STREAM_ERROR_PREFIX = b'data: {"error":'  # an error after a stream started: one event of its own


def error_code(body: bytes) -> str | None:
    """The `error.code` of an OpenAI error body, or of a stream's error event."""
    if body.startswith(STREAM_ERROR_PREFIX):
        body = body[len(b"data: "):].split(b"\n", 1)[0]
    try:
        error = orjson.loads(body).get("error")
    except (ValueError, AttributeError):  # not JSON, or not an object: no code to tell
        return None
    return error.get("code") if isinstance(error, dict) else None


class AccessLog:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started_s = time.monotonic()
        answer = {"status": 0, "code": None}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
            elif message["type"] == "http.response.body" and answer["code"] is None:
                body = message.get("body", b"")
                if answer["status"] >= 400 or body.startswith(STREAM_ERROR_PREFIX):
                    answer["code"] = error_code(body)
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:  # answered by Starlette's error handler, outside this middleware
            if not answer["status"]:
                answer["status"], answer["code"] = 500, "internal"
            raise
        finally:
            client = scope.get("client") or ("-", 0)
            log.info('cbatch http: %s %s "%s %s" %s %s %.3fs', client[0], scope.get(TENANT_SCOPE_KEY, "-"),
                     scope["method"], scope["path"],
                     answer["status"] or "-", answer["code"] or "-", time.monotonic() - started_s)
