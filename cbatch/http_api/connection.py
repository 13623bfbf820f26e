"""The HTTP connection protocol: uvicorn's, with a header timeout, on httptools' parser.

uvicorn closes a connection that stays idle after a response (`timeout_keep_alive`) but
waits forever for a first request, or for a request whose headers arrive a byte at a
time: enough such connections hold every descriptor of the server. Here a connection
must have sent a request's headers within HEADER_TIMEOUT_S of opening or of its last
response's end; a request being answered (a long stream included) is never cut.

The timeout is a mixin over both of uvicorn's protocols: httptools' (a C parser, the
default: the HTTP process spends less CPU per request on it) and h11's (pure Python),
which CBATCH_HTTP_PARSER=h11 picks, to measure one against the other
(scripts/bench.py http_cpu). CBATCH_HTTP_LOOP=uvloop likewise runs the server on uvloop's
event loop instead of asyncio's own, when uvloop is installed.
"""

import asyncio
import os

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0
PARSER_ENV = "CBATCH_HTTP_PARSER"  # "httptools" (default) or "h11"
LOOP_ENV = "CBATCH_HTTP_LOOP"  # "asyncio" (default) or "uvloop"


class _HeaderTimeout:
    """Over a uvicorn protocol, which has `loop`, `transport`, `cycle` and these callbacks."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._on_header_timeout)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._header_timer.cancel()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._on_header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_timer.cancel()
        super().connection_lost(exc)

    def _on_header_timeout(self) -> None:
        is_answering = self.cycle is not None and not self.cycle.response_complete
        if not is_answering and not self.transport.is_closing():
            self.transport.close()


class TimedHttpToolsProtocol(_HeaderTimeout, HttpToolsProtocol):
    pass


class TimedH11Protocol(_HeaderTimeout, H11Protocol):
    pass


def timed_protocol() -> type:
    return TimedH11Protocol if os.environ.get(PARSER_ENV) == "h11" else TimedHttpToolsProtocol


def choose_event_loop() -> None:
    """Before the server's loop is made: uvloop's when CBATCH_HTTP_LOOP=uvloop."""
    if os.environ.get(LOOP_ENV) == "uvloop":
        import uvloop  # only for this measurement: not a dependency

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
