"""A `/v1/messages` request's answer on its way to the caller: the message whole, or its
events (cbatch/anthropic/messages_output.py) as server-sent events named by their type,
on the chat path's Generation (generation.py); errors in Anthropic's shape."""

import asyncio

from cbatch.anthropic.messages_output import MessageEvents, anthropic_error_body
from cbatch.errors import CbatchError
from cbatch.http_api.generation import Generation, streaming_out
from cbatch.http_api.json_io import sse_event

COUNT_WAIT_S = 1.0  # a count is a tokenizing pass, milliseconds; past this message_start says 0


def _events_of_round(events: MessageEvents, arrivals: list) -> list[dict]:
    made = []
    for _, chunk in arrivals:
        made += events.push(chunk.text, chunk.finish_reason, chunk.usage, chunk.stop_string)
    return made


async def collect_message(gen: Generation, events: MessageEvents) -> dict:
    """The message of a request that does not stream, once it has ended."""
    while not any(event["type"] == "message_stop" for event in _events_of_round(events, await gen.next_round())):
        pass
    return events.message


async def _prompt_tokens(gen: Generation) -> int:
    """The prompt's tokens, for message_start (the generation's own count comes with its
    end): a count by the worker's preparer, or 0 if it does not come at once."""
    try:
        return await asyncio.wait_for(gen.state.client.count_tokens(gen.api.bodies[0]), COUNT_WAIT_S)
    except (CbatchError, asyncio.TimeoutError):
        return 0


async def stream_message(gen: Generation, events: MessageEvents, first_round: list):
    """The events, a round's in one write; an error after the 200 went out is an `error`
    event, and the stream ends."""
    async with streaming_out(gen):
        made = events.start(await _prompt_tokens(gen)) + _events_of_round(events, first_round)
        while True:
            yield b"".join(sse_event(event) for event in made)
            if made and made[-1]["type"] == "message_stop":
                return
            try:
                made = _events_of_round(events, await gen.next_round())
            except CbatchError as err:
                gen.count_error(err)
                yield sse_event(anthropic_error_body(err))
                return
