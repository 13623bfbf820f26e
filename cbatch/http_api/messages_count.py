"""`POST /v1/messages/count_tokens`: the tokens of a Messages API request's prompt as the
model would see it (its system prompt, messages and tools rendered by the model's chat
template, images' positions counted), counted by the decode worker's preparer; nothing is
generated. Anthropic's answer shape, `{"input_tokens": N}`, and its error shape."""

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cbatch.anthropic.messages_output import anthropic_error_body
from cbatch.anthropic.messages_request import parse_messages_request
from cbatch.errors import CbatchError
from cbatch.http_api.json_io import json_body, json_response
from cbatch.http_api.state import HttpState

ENDPOINT = "count_tokens"  # the metrics' endpoint label


def _parse(state: HttpState, body: bytes) -> dict:
    raw = json_body(body)
    if isinstance(raw, dict):
        raw = {**raw, "max_tokens": 1}  # a count has no max_tokens; the request's parsing wants one
    api = parse_messages_request(raw, state.model_names, state.reasoning, tool_format=state.client.tool_format,
                                 keeps_billing_header=bool(state.client.info.get("keeps_billing_header")))
    return api.bodies[0]


async def count_tokens_endpoint(state: HttpState, request: Request) -> Response:
    refusal = await state.refusal()
    if refusal is not None:
        return state.error(ENDPOINT, refusal, shape=anthropic_error_body)
    try:
        body = await run_in_threadpool(_parse, state, await request.body())
        return json_response({"input_tokens": await state.client.count_tokens(body)})
    except CbatchError as err:
        return state.error(ENDPOINT, err, shape=anthropic_error_body)
