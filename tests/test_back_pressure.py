"""Back-pressure from a client that holds more of a request than its caller took: an
asyncio caller (the HTTP server is one) that stops taking a stream's chunks for a while
gets every token, coalesced, while the daemon pauses its request instead of the client
holding the answer without bound."""

import asyncio

from daemonkit import wait_until

from cbatch.client import AsyncClient
from cbatch.client.session import MAX_UNTAKEN_TOKENS

NUM_TOKENS = 12_000
LOOK_S = 60.0  # at most, for the request to be seen paused (a loaded machine decodes slowly)


def test_a_caller_that_stops_taking_chunks_pauses_its_request_and_gets_every_token(start_daemon, tiny_model_path):
    daemon = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 13_000))

    def num_paused() -> int:
        with daemon.client() as other:
            return other.stats()["num_paused"]

    async def read_slowly() -> tuple[list, bool]:
        client = await AsyncClient.connect(daemon.endpoint)
        try:
            chunks, saw_paused = [], False
            async for chunk in client.stream(prompt="a slow caller", max_tokens=NUM_TOKENS, ignore_eos=True,
                                             temperature=0):
                chunks.append(chunk)
                if not saw_paused:  # the first chunk: the caller then takes nothing until the daemon pauses
                    deadline_s = asyncio.get_running_loop().time() + LOOK_S
                    while not saw_paused and asyncio.get_running_loop().time() < deadline_s:
                        await asyncio.sleep(0.1)
                        saw_paused = (await client.stats())["num_paused"] >= 1
            return chunks, saw_paused
        finally:
            await client.close()

    chunks, saw_paused = asyncio.run(read_slowly())
    assert saw_paused
    assert chunks[-1].finish_reason == "length"
    assert sum(len(chunk.token_ids) for chunk in chunks) == NUM_TOKENS
    assert len(chunks) < NUM_TOKENS - MAX_UNTAKEN_TOKENS  # coalesced: what waited came as one chunk
    wait_until(lambda: num_paused() == 0, 60)
