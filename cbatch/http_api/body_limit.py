"""Every request body bounded as it arrives: a body past the bound is answered 413
`too_large` (its declared Content-Length is refused before any of it is read, and a
chunked one as soon as its count passes the bound), so no caller can make an HTTP process
hold, parse or spool a body of any size. Uploads (/v1/files) have their own, larger bound
(batches_api.py).

The bound covers the largest legal request: MIN_BODY_BYTES of JSON beside the images a
request may carry (--max-images of --max-image-bytes each, base64 adds a third), computed
by the daemon and handed to each server (max_body_bytes)."""

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cbatch.config import EngineConfig
from cbatch.errors import TOO_LARGE, CbatchError
from cbatch.http_api.json_io import json_response
from cbatch.openai.mapping import error_body, error_status

MIN_BODY_BYTES = 16 << 20
UPLOAD_PATHS = ("/v1/files",)


def max_body_bytes(max_images: int, max_image_bytes: int) -> int:
    return MIN_BODY_BYTES + max_images * (4 * max_image_bytes // 3 + 4)


DEFAULT_MAX_BODY_BYTES = max_body_bytes(EngineConfig.max_images, EngineConfig.max_image_bytes)


def _too_large(max_bytes: int) -> CbatchError:
    return CbatchError(TOO_LARGE, f"the request body is larger than {max_bytes / (1 << 20):.1f} MiB, the most this "
                                  "server reads (16 MiB beside --max-images images of --max-image-bytes each)")


class BoundedBodies:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UPLOAD_PATHS:
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await _answer(_too_large(self.max_bytes), scope, receive, send)
            return
        num_bytes, is_answering = 0, False

        async def bounded_receive() -> Message:
            nonlocal num_bytes
            message = await receive()
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                raise _too_large(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal is_answering
            is_answering = is_answering or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, watched_send)
        except CbatchError as err:  # read outside an endpoint's own error handling
            if err.code != TOO_LARGE or is_answering:
                raise
            await _answer(err, scope, receive, send)


async def _answer(err: CbatchError, scope: Scope, receive: Receive, send: Send) -> None:
    # The connection closes after it: the rest of the body is never read.
    response = json_response(error_body(err), error_status(err.code), {"connection": "close"})
    await response(scope, receive, send)
