"""POST /v1/embeddings: OpenAI's embeddings API over the daemon's EMBED requests.

Vectors are L2-normalized, as OpenAI's are; `encoding_format: "base64"` sends each as the
base64 of its float32 little-endian bytes, as OpenAI does. The inputs of one request are
embedded together (several decodes when they exceed one batch), and requests from
several callers that wait together share a decode.
"""

import asyncio

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cbatch.errors import CbatchError
from cbatch.http_api.auth import TENANT_SCOPE_KEY
from cbatch.http_api.hangup import unless_hung_up
from cbatch.http_api.json_io import json_body, json_bytes
from cbatch.http_api.state import HttpState
from cbatch.openai.mapping import embedding_response, parse_embedding_request

ENDPOINT = "embeddings"


async def embeddings_endpoint(state: HttpState, request: Request) -> Response:
    refusal = await state.refusal()
    if refusal is not None:
        return state.error(ENDPOINT, refusal)
    state.num_in_flight += 1
    try:
        api = parse_embedding_request(json_body(await request.body()), state.model_names)
        work = asyncio.ensure_future(state.client.embeddings(api.inputs, api.dimensions,
                                                             request.scope.get(TENANT_SCOPE_KEY)))
        is_answered, result = await unless_hung_up(request, work)
        if not is_answered:  # the client's cancel reached the daemon: what it had not embedded never is
            state.metrics.disconnects.labels(ENDPOINT).inc()
            return Response(status_code=499)
        state.metrics.on_embedded(result.prompt_tokens)
        return Response(await run_in_threadpool(_response_body, api, result), media_type="application/json")
    except CbatchError as err:
        return state.error(ENDPOINT, err)
    finally:
        state.num_in_flight -= 1  # after the body is made: a drain waits for it


def _response_body(api, result) -> bytes:
    """The response's JSON, encoded a vector at a time in a worker thread: between two the
    event loop gets the interpreter, which one encoding of them all would hold throughout."""
    response = embedding_response(api, result.data, result.prompt_tokens)
    vectors = b",".join(json_bytes(item) for item in response.pop("data"))
    return b'{"data":[' + vectors + b"]," + json_bytes(response)[1:]
