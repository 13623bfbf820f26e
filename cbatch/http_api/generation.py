"""One API request's choices on their way from the daemon to the HTTP caller.

The client hands arrivals over a round at a time (all that came by one wake-up). A
choice's chunks of one round go out as one chunk, and a stream's events of one round as
one write: when the server falls behind the decode steps, it sends fewer, larger events
instead of falling further behind (OpenAI clients take several tokens' text in one
chunk, and llama-server and vLLM send them so too).
"""

import asyncio
import contextlib
import dataclasses
import time

from cbatch.client.streams import merge_chunks
from cbatch.errors import UNAVAILABLE, CbatchError
from cbatch.http_api.json_io import sse
from cbatch.http_api.metrics import TokenTimer
from cbatch.http_api.state import HttpState
from cbatch.openai.completions_output import ResponseBuilder, WholeResponse
from cbatch.openai.mapping import CHAT, ApiRequest, error_body, error_status


class Generation:
    def __init__(self, state: HttpState, api: ApiRequest, endpoint: str, is_cancel_an_error: bool = True):
        """`is_cancel_an_error`: a choice the daemon cancelled ends the request with an error,
        for the APIs that have no such ending (chat and completions; the Responses API has
        its own `cancelled` status)."""
        self.state, self.api, self.endpoint = state, api, endpoint
        self.is_cancel_an_error = is_cancel_an_error
        self.builder = ResponseBuilder(api, state.fingerprint)
        self.rounds = state.client.stream_batch_rounds([{**b, "id": i} for i, b in enumerate(api.bodies)],
                                                       max_in_flight=len(api.bodies), is_whole=not api.is_stream)
        arrived_s = time.monotonic()
        self.timers = [TokenTimer(state.metrics, arrived_s) for _ in api.bodies]
        self.usages: list[dict | None] = [None] * len(api.bodies)
        self._finished_prompts: set[int] = set()
        self._error: CbatchError | None = None  # arrived in a round after chunks that went out first

    async def next_round(self) -> list[tuple[int, object]]:
        """[(choice, chunk)], one merged chunk per choice that got something; a request
        error raises CbatchError (after the chunks that arrived before it)."""
        if self._error is not None:
            raise self._error
        chunks_by_choice: dict[int, list] = {}
        arrivals = await self.rounds.__anext__()
        now_s = time.monotonic()  # when the round came: the tokens' time, for the latency metrics
        for choice, item in arrivals:
            if isinstance(item, CbatchError):
                self._error = item
                break
            self.timers[choice].on_tokens(len(item.token_ids), now_s)
            if item.finish_reason == "cancelled" and self.is_cancel_an_error:
                chunks_by_choice.setdefault(choice, []).append(dataclasses.replace(item, finish_reason=None))
                self._error = self._cancelled_error()
                break
            chunks_by_choice.setdefault(choice, []).append(item)
            if item.finish_reason:
                self._on_finished(choice, item)
        if not chunks_by_choice and self._error is not None:
            raise self._error
        return [(choice, merge_chunks(chunks)) for choice, chunks in chunks_by_choice.items()]

    @staticmethod
    def _cancelled_error() -> CbatchError:
        """The daemon cancels a running request this server did not cancel when this server
        read too slowly to keep up (a drain's end is an error of its own, shutting_down)."""
        return CbatchError(UNAVAILABLE, "the daemon cancelled the request before it finished; send it again")

    def _on_finished(self, choice: int, chunk) -> None:
        self.usages[choice] = chunk.usage
        prompt = self.api.prompt_of_choice[choice]
        self.state.metrics.on_finished(self.endpoint, chunk.finish_reason, chunk.usage,
                                       prompt not in self._finished_prompts)
        self._finished_prompts.add(prompt)

    def count_error(self, err: CbatchError) -> None:
        """An error that reaches the caller after the stream began (an event, not a status)."""
        self.state.metrics.errors.labels(self.endpoint, str(error_status(err.code)), err.code).inc()

    async def close(self) -> None:
        await self.rounds.aclose()  # cancels choices still running


async def collect(gen: Generation) -> dict:
    """The whole response of a request that does not stream."""
    whole = WholeResponse(gen.builder)
    while whole.num_left:
        for choice, chunk in await gen.next_round():
            whole.add(choice, chunk)
    return whole.response()


@contextlib.asynccontextmanager
async def streaming_out(gen: Generation):
    """Around a response's stream: a caller that hangs up mid-stream is counted, and the
    generation ends (its choices cancelled if still running) however the stream ends."""
    try:
        yield
    except (asyncio.CancelledError, GeneratorExit):
        gen.state.metrics.disconnects.labels(gen.endpoint).inc()
        raise
    finally:
        await gen.close()
        gen.state.num_in_flight -= 1


async def stream_events(gen: Generation, first_round: list):
    """Server-sent events, a round's in one write: chunks, the usage chunk if asked, [DONE]."""
    num_done = 0
    async with streaming_out(gen):
        arrivals = first_round
        is_chat = gen.api.kind == CHAT
        events = [sse(gen.builder.role_chunk(choice)) for choice in range(len(gen.api.bodies)) if is_chat]
        while True:
            for choice, chunk in arrivals:
                events += [sse(c) for c in gen.builder.chunks(choice, chunk.text, chunk.finish_reason,
                                                              gen.builder.logprobs(choice, chunk.logprobs))]
                num_done += chunk.finish_reason is not None
            if num_done == len(gen.api.bodies):
                if gen.api.include_usage:
                    events.append(sse(gen.builder.usage_chunk(gen.usages)))
                yield b"".join(events) + b"data: [DONE]\n\n"
                return
            yield b"".join(events)
            events = []
            try:
                arrivals = await gen.next_round()
            except CbatchError as err:  # after the 200 went out: an error event, then the end
                gen.count_error(err)
                yield sse(error_body(err)) + b"data: [DONE]\n\n"
                return
