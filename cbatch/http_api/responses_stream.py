"""A `/v1/responses` request's answer on its way to the caller: whole, or as its events
(cbatch/openai/responses_output.py), on the chat path's Generation (generation.py)."""

from cbatch.errors import CbatchError
from cbatch.http_api.generation import Generation, streaming_out
from cbatch.http_api.json_io import sse_event
from cbatch.openai.mapping import error_body
from cbatch.openai.responses_output import ResponseEvents


def _events_of_round(events: ResponseEvents, arrivals: list) -> list[dict]:
    made = []
    for _, chunk in arrivals:
        made += events.push(chunk.text, len(chunk.token_ids), chunk.finish_reason, chunk.usage)
    return made


async def collect_response(gen: Generation, events: ResponseEvents) -> dict:
    """The response object of a request that does not stream: its events' last."""
    while True:
        made = _events_of_round(events, await gen.next_round())
        if made and made[-1]["type"] in ("response.completed", "response.incomplete"):
            return made[-1]["response"]


async def stream_response(gen: Generation, events: ResponseEvents, first_round: list):
    """The events as server-sent events, a round's in one write; an error after the 200
    went out is an `error` event, and the stream ends."""
    async with streaming_out(gen):
        made = events.start() + _events_of_round(events, first_round)
        while True:
            yield b"".join(sse_event(event) for event in made)
            if made and made[-1]["type"] in ("response.completed", "response.incomplete"):
                return
            try:
                made = _events_of_round(events, await gen.next_round())
            except CbatchError as err:
                gen.count_error(err)
                yield sse_event(events.event("error", **{k: v for k, v in error_body(err)["error"].items()
                                                         if k in ("message", "code", "param")}))
                return
