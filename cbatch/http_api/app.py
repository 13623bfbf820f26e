"""The OpenAI-compatible HTTP API's routes: a Starlette app, one more client of the daemon
(an AsyncClient; it reads tokens from the shared-memory ring when the daemon's endpoint is
ipc:// and a request asks for no logprobs, and takes them relayed otherwise). The process
that serves it under uvicorn, drains and watches the daemon is cbatch/http_api/server.py.
"""

import asyncio

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from cbatch.anthropic.messages_output import MessageEvents, anthropic_error_body
from cbatch.anthropic.messages_request import parse_messages_request
from cbatch.errors import INVALID_REQUEST, NOT_FOUND, SHUTTING_DOWN, UNAVAILABLE, CbatchError
from cbatch.http_api.access_log import AccessLog
from cbatch.http_api.auth import (
    TENANT_SCOPE_KEY,
    ApiKeys,
    RequireApiKey,
    check_choices_fit,
)
from cbatch.http_api.batches_api import batch_routes
from cbatch.http_api.body_limit import DEFAULT_MAX_BODY_BYTES, BoundedBodies
from cbatch.http_api.embeddings import embeddings_endpoint
from cbatch.http_api.generation import Generation, collect, stream_events
from cbatch.http_api.hangup import wait_disconnect
from cbatch.http_api.json_io import json_body, json_response
from cbatch.http_api.messages_count import count_tokens_endpoint
from cbatch.http_api.messages_stream import collect_message, stream_message
from cbatch.http_api.metrics import kv_cache_usage
from cbatch.http_api.model_list import anthropic_model, anthropic_models, model_entry
from cbatch.http_api.responses_stream import collect_response, stream_response
from cbatch.http_api.schema_notes import unenforced_header
from cbatch.http_api.state import HEALTH_TIMEOUT_S, HttpState
from cbatch.jobs.batches import BatchStore
from cbatch.openai.mapping import CHAT, COMPLETION, ApiRequest, error_body, parse_api_request
from cbatch.openai.responses_output import ResponseEvents, echoed_fields
from cbatch.openai.responses_request import parse_responses_request

RESPONSES = "responses"  # POST /v1/responses: a chat request answered in the Responses API's shapes
MESSAGES = "messages"  # POST /v1/messages: a chat request in Anthropic's Messages API's shapes
# the metrics' endpoint label
ENDPOINTS = {CHAT: "chat", COMPLETION: "completions", RESPONSES: "responses", MESSAGES: "messages"}
# The APIs whose answers are events of their own: how a whole one is collected, how a stream is written.
COLLECT = {RESPONSES: collect_response, MESSAGES: collect_message}
STREAM = {RESPONSES: stream_response, MESSAGES: stream_message}
ERROR_SHAPES = {MESSAGES: anthropic_error_body}
# A body this small that names no schema, tools or grammar is parsed on the event loop:
# handing it to a worker thread and back costs more CPU than parsing it, about a tenth of
# the HTTP process's CPU for a short completion. A schema is walked (its depth, its objects
# closed, its numbers bounded), and so are tools' parameter schemas, which take a while:
# any body that names one of these fields anywhere (a message's text included) is parsed
# on a thread, as larger ones are.
MAX_INLINE_PARSE_BYTES = 8 << 10
SCHEMA_FIELD_NAMES = (b'"tools"', b'"functions"', b'"response_format"', b'"text"', b'"grammar"', b'"json_schema"')


def _parse(state: HttpState, kind: str, body: bytes) -> tuple[ApiRequest, ResponseEvents | MessageEvents | None]:
    """A generation request read: run in a worker thread, as checking a JSON schema or a
    tool's parameters takes a while (bounded), and the event loop
    meanwhile serves the other requests' streams."""
    api, events = _parsed(state, kind, body)
    api.headers = unenforced_header(api.bodies)
    return api, events


def _parsed(state: HttpState, kind: str, body: bytes) -> tuple[ApiRequest, ResponseEvents | MessageEvents | None]:
    raw = json_body(body)
    keeps_billing_header = bool(state.client.info.get("keeps_billing_header"))  # --keep-billing-header
    if kind == RESPONSES:
        api = parse_responses_request(raw, state.model_names, state.reasoning, tool_format=state.client.tool_format,
                                      keeps_billing_header=keeps_billing_header)
        return api, ResponseEvents(api, echoed_fields(raw))
    if kind == MESSAGES:
        api = parse_messages_request(raw, state.model_names, state.reasoning, tool_format=state.client.tool_format,
                                     keeps_billing_header=keeps_billing_header)
        return api, MessageEvents(api)
    return parse_api_request(kind, raw, state.model_names, state.reasoning, tool_format=state.client.tool_format,
                             keeps_billing_header=keeps_billing_header), None


def is_parsed_inline(body: bytes) -> bool:
    return len(body) <= MAX_INLINE_PARSE_BYTES and not any(name in body for name in SCHEMA_FIELD_NAMES)


async def _read_request(state: HttpState, request: Request, kind: str):
    """(the request as cbatch bodies, its events' shape), each body the key's tenant's;
    a large body is parsed off the event loop. A server that cannot take it now (starting,
    draining) refuses it before its body is read."""
    refusal = await state.refusal()
    if refusal is not None:
        raise refusal
    body = await request.body()
    if is_parsed_inline(body):
        api, events = _parse(state, kind, body)
    else:
        api, events = await run_in_threadpool(_parse, state, kind, body)
    check_choices_fit(request.scope, len(api.bodies))
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    if tenant is not None:  # the key's tenant, whatever the caller's body said
        api.bodies = [{**body, "tenant": tenant} for body in api.bodies]
    return api, events


async def _generate(state: HttpState, request: Request, kind: str) -> Response:
    """A completions, chat or responses request: errors before the first token get their
    status; a stream then goes out as server-sent events; a caller that hangs up cancels it."""
    endpoint = ENDPOINTS[kind]
    shape = ERROR_SHAPES.get(kind, error_body)
    try:
        api, events = await _read_request(state, request, kind)
    except CbatchError as err:
        return state.error(endpoint, err, shape=shape)
    state.num_in_flight += 1
    gen = Generation(state, api, endpoint, is_cancel_an_error=kind != RESPONSES)
    collect_events, stream_out = COLLECT.get(kind), STREAM.get(kind)
    is_streaming_out = False
    watcher = asyncio.create_task(wait_disconnect(request))
    try:
        if api.is_stream:
            work = asyncio.ensure_future(gen.next_round())
        else:
            work = asyncio.ensure_future(collect_events(gen, events) if collect_events else collect(gen))
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client hung up: cancel its choices
            state.metrics.disconnects.labels(endpoint).inc()
            work.cancel()
            await asyncio.wait([work])  # the stream is closed below, once nothing runs it
            return Response(status_code=499)
        result = work.result()
        if not api.is_stream:
            return json_response(result, headers=api.headers)
        is_streaming_out = True
        stream = stream_out(gen, events, result) if stream_out else stream_events(gen, result)
        return StreamingResponse(stream, media_type="text/event-stream", headers=api.headers)
    except CbatchError as err:
        return state.error(endpoint, err, api.param_of(err), shape=shape)
    finally:
        watcher.cancel()
        if not is_streaming_out:
            await gen.close()
            state.num_in_flight -= 1


async def _models(state: HttpState, request: Request) -> Response:
    """Every name the model is served under (model_list.py), or the one a path names."""
    if not state.has_been_ready:
        await state.status()  # the tags and the context come with the daemon's first "ok"
    info = state.client.info if state.client else {}
    model_id = request.path_params.get("model_id")
    if model_id is not None and model_id not in state.model_names:
        return state.error("models", CbatchError(NOT_FOUND, f"model {model_id!r} is not served here; "
                                                            f"GET /v1/models lists {state.model_names}"))
    names = state.model_names if model_id is None else [model_id]
    entries = [model_entry(name, state.started, state.ctx_per_seq, info, state.reasoning) for name in names]
    if b"anthropic-version" in dict(request.scope["headers"]):  # Anthropic's SDKs read their own shape
        return json_response(anthropic_models(entries) if model_id is None else anthropic_model(entries[0]))
    return json_response({"object": "list", "data": entries} if model_id is None else entries[0])


async def _health(state: HttpState, request: Request) -> Response:
    """200 while the model serves; with batch jobs, `batch_jobs` says whether their runner
    runs ("running") or is being restarted ("restarting"): jobs wait meanwhile, chat does not."""
    status = await state.status()
    if status == "ok":
        return json_response({"status": status, **({"batch_jobs": state.batch_jobs} if state.batch_jobs else {})})
    code = SHUTTING_DOWN if status == "draining" else UNAVAILABLE
    return json_response({"status": status, **error_body(CbatchError(code, f"the server is {status}"))}, 503)


async def _loads(state: HttpState, request: Request) -> Response:
    """The daemon's load in SGLang's worker format, which routers (smg) poll: one entry
    per data-parallel rank, and a daemon is one."""
    stats = await _daemon_stats(state)
    if not stats:
        return state.error("loads", CbatchError(UNAVAILABLE, "the daemon's load is not known yet"))
    return json_response({"loads": [{"dp_rank": 0, "worker_generation": f"{state.model_names[0]}@{state.started}",
                                     "num_running_reqs": stats["num_active"], "num_waiting_reqs": stats["num_queued"],
                                     "token_usage": kv_cache_usage(stats)}]})


async def _daemon_stats(state: HttpState) -> dict:
    try:
        return await asyncio.wait_for(state.client.stats(), HEALTH_TIMEOUT_S) if state.client else {}
    except (CbatchError, asyncio.TimeoutError):
        return {}


async def _metrics(state: HttpState, request: Request) -> Response:
    return Response(state.metrics.render(await _daemon_stats(state)),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


def make_app(state: HttpState, api_keys: ApiKeys | None = None, store: BatchStore | None = None,
             max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """`store`: the daemon's files and batch jobs (/v1/files, /v1/batches); None serves neither.
    A body past `max_body_bytes` is refused (body_limit.py)."""
    def bind(handler, *args):
        async def endpoint(request: Request) -> Response:
            return await handler(state, request, *args)
        return endpoint

    async def no_route(request: Request, exc: HTTPException) -> Response:
        """Unknown paths and methods answer in OpenAI's error shape, as every other error."""
        if exc.status_code == 405:
            err = CbatchError(INVALID_REQUEST, f"{request.method} is not allowed on {request.url.path}")
        else:
            err = CbatchError(NOT_FOUND, f"no route {request.method} {request.url.path}; this server serves "
                                         "/v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, "
                                         "/v1/embeddings, /v1/models, /v1/files, /v1/batches, /v1/loads, /health, "
                                         "/metrics")
        return json_response(error_body(err), exc.status_code, exc.headers)

    middleware = [Middleware(AccessLog), *([Middleware(RequireApiKey, api_keys=api_keys)] if api_keys else []),
                  Middleware(BoundedBodies, max_bytes=max_body_bytes)]  # after the key check: no reading for strangers
    return Starlette(middleware=middleware, exception_handlers={404: no_route, 405: no_route}, routes=[
        Route("/v1/completions", bind(_generate, COMPLETION), methods=["POST"]),
        Route("/v1/chat/completions", bind(_generate, CHAT), methods=["POST"]),
        Route("/v1/embeddings", bind(embeddings_endpoint), methods=["POST"]),
        Route("/v1/responses", bind(_generate, RESPONSES), methods=["POST"]),
        Route("/v1/messages", bind(_generate, MESSAGES), methods=["POST"]),
        Route("/v1/messages/count_tokens", bind(count_tokens_endpoint), methods=["POST"]),
        Route("/v1/models", bind(_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", bind(_models), methods=["GET"]),
        Route("/health", bind(_health), methods=["GET"]),
        Route("/metrics", bind(_metrics), methods=["GET"]),
        Route("/v1/loads", bind(_loads), methods=["GET"]),
        *(batch_routes(state, store) if store is not None else []),
    ])
