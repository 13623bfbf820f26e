"""POST /v1/embeddings: OpenAI's embeddings API over the daemon's EMBED requests.

Vectors are L2-normalized, as OpenAI's are; `encoding_format: "base64"` sends each as the
base64 of its float32 little-endian bytes, as OpenAI does. The inputs of one request are
embedded together (several decodes when they exceed one batch), and requests from
several callers that wait together share a decode.
"""

from starlette.requests import Request
from starlette.responses import Response

from cbatch.errors import CbatchError
from cbatch.http_api.openai_mapping import embedding_response, parse_embedding_request
from cbatch.http_api.state import HttpState, json_body, json_response

ENDPOINT = "embeddings"


async def embeddings_endpoint(state: HttpState, request: Request) -> Response:
    refusal = await state.refusal()
    if refusal is not None:
        return state.error(ENDPOINT, refusal)
    state.num_in_flight += 1
    try:
        api = parse_embedding_request(json_body(await request.body()), state.model_names)
        result = await state.client.embeddings(api.inputs, api.dimensions)
    except CbatchError as err:
        return state.error(ENDPOINT, err)
    finally:
        state.num_in_flight -= 1
    state.metrics.on_embedded(result.prompt_tokens)
    return json_response(embedding_response(api, result.data, result.prompt_tokens))
