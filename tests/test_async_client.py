"""The asyncio client on its failure paths: a killed decode worker, and callers that stop
reading early (their requests must stop taking decode slots)."""

import asyncio
import os
import signal
import time
from collections import deque

import pytest
from common import GREEDY
from daemonkit import Daemon, serve_module

from cbatch.client.async_client import AsyncClient
from cbatch.errors import CbatchError

# Long enough that no request here ends by itself within a test (8000 tokens take a
# minute on the tiny model): only a cancel ends it.
ENDLESS = {"prompt": "on and on", "max_tokens": 16000, **GREEDY}
DAEMON_ARGS = ("--parallel", "4", "--ctx-size", str(4 * 16384))
GONE_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    yield from serve_module(Daemon(tiny_model_path, *DAEMON_ARGS))


async def wait_for_stats(client: AsyncClient, predicate, timeout_s: float = GONE_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while not predicate(stats := await client.stats()):
        assert time.monotonic() < deadline, f"condition not reached in time: {stats}"
        await asyncio.sleep(0.05)
    return stats


def in_async_client(daemon, scenario):
    async def main():
        client = await AsyncClient.connect(daemon.endpoint)
        try:
            return await scenario(client)
        finally:
            await client.close()

    return asyncio.run(main())


def test_break_out_of_async_for_cancels_the_request(daemon):
    async def scenario(client):
        before = await wait_for_stats(client, lambda s: s["num_in_flight"] == 0)
        async for chunk in client.stream(**ENDLESS):
            assert chunk.token_ids
            break
        # The generator is closed by the event loop once dropped; its cleanup cancels.
        await wait_for_stats(client, lambda s: s["num_in_flight"] == 0)
        return before, await wait_for_stats(client, lambda s: s["num_active"] == 0)

    before, after = in_async_client(daemon, scenario)
    cancelled = [stats["num_requests_by_outcome"].get("cancelled", 0) for stats in (before, after)]
    assert cancelled[1] == cancelled[0] + 1  # ended (cancelled), not lost


def test_break_out_of_async_stream_batch_cancels_every_outstanding_request(daemon):
    async def scenario(client):
        before = await wait_for_stats(client, lambda s: s["num_in_flight"] == 0)
        pulled = []

        def items():
            for i in range(12):
                pulled.append(i)
                yield {"id": i, **ENDLESS}

        async for position, chunk in client.stream_batch(items(), max_in_flight=3):
            assert not isinstance(chunk, CbatchError)
            break
        await wait_for_stats(client, lambda s: s["num_in_flight"] == 0)
        return before, await wait_for_stats(client, lambda s: s["num_active"] == 0), pulled

    before, after, pulled = in_async_client(daemon, scenario)
    assert pulled == [0, 1, 2]  # nothing beyond max_in_flight was submitted
    cancelled = [stats["num_requests_by_outcome"].get("cancelled", 0) for stats in (before, after)]
    assert cancelled[1] == cancelled[0] + 3


def test_cancel_ends_an_async_stream_keeping_what_it_produced(daemon):
    async def scenario(client):
        stream, chunks = client.submit(**ENDLESS), []
        async for chunk in client.read(stream):
            chunks.append(chunk)
            if len(chunks) == 3:
                client.cancel(stream.request_id)
        return chunks

    chunks = in_async_client(daemon, scenario)
    assert chunks[-1].finish_reason == "cancelled" and all(chunk.token_ids for chunk in chunks[:3])


class LookCountingDeque(deque):
    """A stream's pending chunks, counting how often anyone checked for some."""

    num_looks = 0

    def __len__(self):
        self.num_looks += 1
        return super().__len__()


def test_a_waiting_stream_sleeps_while_other_streams_get_tokens(daemon):
    """A reader whose request is queued is not woken by the tokens of the requests ahead
    of it (the HTTP server waits on every open request at once), and still gets its own."""
    async def scenario(client):
        busy_streams = [client.submit(**ENDLESS) for _ in range(4)]  # every slot of --parallel 4
        busy = client.read(busy_streams[0])
        queued = client.submit(prompt="queued", max_tokens=3, **GREEDY)
        queued.pending = LookCountingDeque()
        reader = asyncio.create_task(anext(client.read(queued)))
        await asyncio.sleep(0)  # the reader runs up to its wait
        looks_before = queued.pending.num_looks
        for _ in range(100):
            assert (await anext(busy)).token_ids
        looks = queued.pending.num_looks - looks_before
        await busy.aclose()
        for stream in busy_streams:  # the queued request gets a slot
            client.cancel(stream.request_id)
        return looks, await asyncio.wait_for(reader, GONE_TIMEOUT_S)

    looks, first = in_async_client(daemon, scenario)
    assert looks == 0 and first.token_ids


def test_async_client_under_a_worker_kill(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *DAEMON_ARGS)

    async def read_all(stream) -> list:
        return [chunk async for chunk in stream]

    async def scenario(client):
        old_pid = (await client.health())["worker_pid"]
        streams = [client.stream(**ENDLESS) for _ in range(2)]
        firsts = [await anext(stream) for stream in streams]
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        outcomes = await asyncio.gather(*(read_all(s) for s in streams), return_exceptions=True)
        failed_s = time.monotonic() - killed_at
        while (health := await client.health())["status"] != "ok":  # the next worker loads
            assert time.monotonic() - killed_at < 60, health
            await asyncio.sleep(0.05)
        again = await client.generate(prompt="again", max_tokens=20, **GREEDY)
        return old_pid, firsts, outcomes, failed_s, health, again

    old_pid, firsts, outcomes, failed_s, health, again = in_async_client(d, scenario)
    assert all(first.token_ids for first in firsts)
    for outcome in outcomes:
        assert isinstance(outcome, CbatchError) and outcome.code == "worker_restarted", outcome
    assert failed_s < 2.0
    assert health["worker_pid"] not in (0, old_pid)
    assert again.finish_reason == "length" and len(again.token_ids) == 20


def test_a_request_wanted_whole_wakes_its_reader_for_its_first_chunk_and_its_end_only(daemon):
    """generate() (and an HTTP response that does not stream) takes a request whole: its
    reader is woken for the first chunk and at the end, not once a step, and still gets every
    token; a streamed read of the same request is woken step by step."""
    body = {"prompt": "whole or streamed", "max_tokens": 64, **GREEDY}

    async def scenario(client):
        wake_ups = []
        on_arrival = client._session._on_arrival
        client._session._on_arrival = lambda key: (wake_ups.append(key), on_arrival(key))
        whole = await client.generate(**body)
        num_whole_wake_ups = len(wake_ups)
        wake_ups.clear()
        streamed = [chunk async for chunk in client.read(client.submit(**body))]
        return whole, num_whole_wake_ups, streamed, len(wake_ups)

    whole, num_whole_wake_ups, streamed, num_streamed_wake_ups = in_async_client(daemon, scenario)
    assert len(whole.token_ids) == 64 and whole.token_ids == [t for chunk in streamed for t in chunk.token_ids]
    assert num_whole_wake_ups <= 3  # first records, the finish (records and finish may come apart)
    assert num_streamed_wake_ups >= 10, num_streamed_wake_ups
