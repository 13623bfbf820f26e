"""The OpenAI-compatible HTTP server: a Starlette app under uvicorn, one more local client
of the daemon (an AsyncClient reading its tokens from the shared-memory ring).

`cbatch-worker --http [HOST:]PORT` runs it as a process of its own beside the front-end
(`python -m cbatch.http_api.app`) on the socket the daemon bound, from before the model
loads (503 until the daemon is ready), restarted if it dies. On SIGTERM it drains: new
requests get 503, in-flight responses finish, then it exits.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from cbatch.client.async_client import AsyncClient
from cbatch.errors import CbatchError, INVALID_REQUEST, SHUTTING_DOWN, UNAVAILABLE
from cbatch.http_api.metrics import HttpMetrics, TokenTimer
from cbatch.http_api.openai_mapping import (CHAT, COMPLETION, RETRY_AFTER_S, ApiRequest, ResponseBuilder, WholeResponse, error_body,
                               error_status, parse_api_request)

log = logging.getLogger("cbatch.http")

CONNECT_RETRY_S = 0.5  # between attempts to reach the daemon at start-up
HEALTH_TIMEOUT_S = 2.0
PARENT_POLL_S = 0.5  # how often the server checks that the daemon that started it lives
DRAIN_POLL_S = 0.05  # while draining, how often it checks whether the last response ended


def _json(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(obj, separators=(",", ":"), ensure_ascii=False), status, headers,
                    media_type="application/json")


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


class HttpState:
    """What the app shares across requests: the daemon client, the model, drain state."""

    def __init__(self, endpoint: str, model_id: str):
        self.endpoint = endpoint
        self.client: AsyncClient | None = None
        self.model_id = model_id
        self.started = int(time.time())
        self.metrics = HttpMetrics()
        self.is_draining = False
        self.has_been_ready = False  # the daemon answered "ok" once: the model has loaded
        self.num_in_flight = 0

    async def connect(self) -> None:
        while self.client is None:
            try:
                self.client = await AsyncClient.connect(self.endpoint)
            except CbatchError as err:
                log.info("cbatch http: daemon not reachable yet (%s)", err.message)
                await asyncio.sleep(CONNECT_RETRY_S)

    async def status(self) -> str:
        """The daemon's health status: "ok", "starting" (loading the model, or restarting
        the decode worker), "draining" or "unavailable"."""
        if self.is_draining or self.client is None:
            return "draining" if self.is_draining else "starting"
        try:
            reply = await asyncio.wait_for(self.client.health(), HEALTH_TIMEOUT_S)
        except (CbatchError, asyncio.TimeoutError):
            return "unavailable"
        self.has_been_ready |= reply["status"] == "ok"
        return reply["status"]

    async def refusal(self) -> CbatchError | None:
        """Why a generation request cannot be taken now. Until the model has loaded the
        daemon would hold the request for as long as loading takes: answer 503 instead.
        (A request during a worker restart is held by the daemon and served after it.)"""
        if self.is_draining:
            return CbatchError(SHUTTING_DOWN, "the server is draining")
        if not self.has_been_ready and await self.status() != "ok":
            return CbatchError(UNAVAILABLE, "the server is starting: the model is not loaded yet")
        return None

    def error(self, endpoint: str, err: CbatchError, param: str | None = None) -> Response:
        status = error_status(err.code)
        self.metrics.errors.labels(endpoint, str(status), err.code).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
        return _json(error_body(err, param), status, headers)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body has been read: receive() waits)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Generation:
    """One API request's choices, read from the daemon as they arrive."""

    def __init__(self, state: HttpState, api: ApiRequest, endpoint: str):
        self.state, self.api, self.endpoint = state, api, endpoint
        self.builder = ResponseBuilder(api, state.model_id)
        self.arrivals = state.client.stream_batch([{**b, "id": i} for i, b in enumerate(api.bodies)],
                                                  max_in_flight=len(api.bodies))
        arrived_s = time.monotonic()
        self.timers = [TokenTimer(state.metrics, arrived_s) for _ in api.bodies]
        self.usages: list[dict | None] = [None] * len(api.bodies)
        self._finished_prompts: set[int] = set()

    async def next(self):
        """(choice, chunk); a request error raises CbatchError."""
        choice, item = await self.arrivals.__anext__()
        if isinstance(item, CbatchError):
            raise item
        self.timers[choice].on_tokens(len(item.token_ids), time.monotonic())
        if item.finish_reason:
            self.usages[choice] = item.usage
            prompt = self.api.prompt_of_choice[choice]
            self.state.metrics.on_finished(self.endpoint, item.finish_reason, item.usage,
                                           prompt not in self._finished_prompts)
            self._finished_prompts.add(prompt)
        return choice, item

    async def close(self) -> None:
        await self.arrivals.aclose()  # cancels choices still running

    def logprobs(self, choice: int, chunk):
        return self.builder.logprobs(choice, getattr(chunk, "logprobs", None))


async def _collect(gen: Generation) -> dict:
    whole = WholeResponse(gen.builder)
    while whole.num_left:
        whole.add(*await gen.next())
    return whole.response()


async def _stream(gen: Generation, first):
    """Server-sent events: one chunk per arrival, the usage chunk if asked, [DONE]."""
    is_first = [True] * len(gen.api.bodies)
    num_done = 0
    try:
        item = first
        while True:
            choice, chunk = item
            yield _sse(gen.builder.chunk(choice, chunk.text, chunk.finish_reason, gen.logprobs(choice, chunk),
                                         is_first[choice]))
            is_first[choice] = False
            num_done += chunk.finish_reason is not None
            if num_done == len(gen.api.bodies):
                break
            try:
                item = await gen.next()
            except CbatchError as err:  # after the 200 went out: an error event, then the end
                gen.state.metrics.errors.labels(gen.endpoint, str(error_status(err.code)), err.code).inc()
                yield _sse(error_body(err))
                break
        if gen.api.include_usage and num_done == len(gen.api.bodies):
            yield _sse(gen.builder.usage_chunk(gen.usages))
        yield b"data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client hung up mid-stream
        gen.state.metrics.disconnects.labels(gen.endpoint).inc()
        raise
    finally:
        await gen.close()
        gen.state.num_in_flight -= 1


def make_app(state: HttpState) -> Starlette:
    async def generate(request: Request, kind: str) -> Response:
        endpoint = "chat" if kind == CHAT else "completions"
        refusal = await state.refusal()
        if refusal is not None:
            return state.error(endpoint, refusal)
        try:
            raw = json.loads(await request.body())
            api = parse_api_request(kind, raw, state.model_id)
        except json.JSONDecodeError as err:
            return state.error(endpoint, CbatchError(INVALID_REQUEST, f"the body is not JSON: {err.msg}"))
        except CbatchError as err:
            return state.error(endpoint, err)
        state.num_in_flight += 1
        gen = Generation(state, api, endpoint)
        is_streaming_out = False
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            work = asyncio.ensure_future(gen.next() if api.is_stream else _collect(gen))
            await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client hung up: cancel its choices
                state.metrics.disconnects.labels(endpoint).inc()
                work.cancel()
                await asyncio.wait([work])  # the stream is closed below, once nothing runs it
                return Response(status_code=499)
            result = work.result()
            if not api.is_stream:
                return _json(result)
            is_streaming_out = True
            return StreamingResponse(_stream(gen, result), media_type="text/event-stream")
        except CbatchError as err:
            return state.error(endpoint, err)
        finally:
            watcher.cancel()
            if not is_streaming_out:
                await gen.close()
                state.num_in_flight -= 1

    async def completions(request: Request) -> Response:
        return await generate(request, COMPLETION)

    async def chat(request: Request) -> Response:
        return await generate(request, CHAT)

    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.started,
                                                  "owned_by": "cbatch"}]})

    async def health(request: Request) -> Response:
        status = await state.status()
        if status == "ok":
            return _json({"status": status})
        code = SHUTTING_DOWN if status == "draining" else UNAVAILABLE
        return _json({"status": status, **error_body(CbatchError(code, f"the server is {status}"))}, 503)

    async def metrics(request: Request) -> Response:
        try:
            stats = await asyncio.wait_for(state.client.stats(), HEALTH_TIMEOUT_S) if state.client else {}
        except (CbatchError, asyncio.TimeoutError):
            stats = {}
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ])


class _DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT start a drain (503 for new requests) instead of closing the socket;
    the server exits once no response is in flight."""

    def __init__(self, config: uvicorn.Config, state: HttpState):
        super().__init__(config)
        self.state = state
        self._drain_asked = asyncio.Event()  # wakes the watch at once: an idle drain ends at once
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig, frame) -> None:
        self.state.is_draining = True
        if self._loop is not None:  # a signal handler: it may run outside the loop's thread
            self._loop.call_soon_threadsafe(self._drain_asked.set)

    async def _watch(self, parent_pid: int) -> None:
        self._loop = asyncio.get_running_loop()
        while not self.should_exit:
            if os.getppid() != parent_pid:  # the daemon is gone: nothing left to serve
                self.state.is_draining = True
            if self.state.is_draining and self.state.num_in_flight == 0:
                self.should_exit = True
            if self.state.is_draining:  # the event stays set: waiting on it would not sleep
                await asyncio.sleep(DRAIN_POLL_S)
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._drain_asked.wait(), PARENT_POLL_S)

    async def run_all(self, sock: socket.socket, parent_pid: int) -> None:
        """Serve at once (503 until the daemon is reached and ready) while connecting."""
        connect = asyncio.create_task(self.state.connect())
        watch = asyncio.create_task(self._watch(parent_pid))
        try:
            await self.serve(sockets=[sock])
        finally:
            connect.cancel()
            watch.cancel()
            if self.state.client is not None:
                await self.state.client.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="cbatch-http")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--fd", type=int, required=True, help="the listening socket, bound by the daemon")
    parser.add_argument("--model-id", required=True, help="the name /v1/models gives the model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    state = HttpState(args.endpoint, args.model_id)
    config = uvicorn.Config(make_app(state), log_level="warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=5)
    server = _DrainingServer(config, state)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which drains us with SIGTERM
    asyncio.run(server.run_all(socket.socket(fileno=args.fd), os.getppid()))


if __name__ == "__main__":
    main()
