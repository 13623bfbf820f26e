"""A daemon that stops taking a client's messages (it cut the client off): both clients
raise `unavailable` once a send has waited the send timeout, and fail what was waiting.

The stand-in front-end welcomes the client and then reads nothing more, so the client's
queues fill after a few thousand submits; the send timeout is shortened for the test."""

import asyncio
import time

import pytest
from daemonkit import ScriptedFrontEnd

import cbatch.client.session
from cbatch.client import Client
from cbatch.client.async_client import AsyncClient
from cbatch.errors import UNAVAILABLE, CbatchError

SEND_TIMEOUT_S = 0.5
GIVE_UP_S = 30.0  # far more than filling the queues takes


@pytest.fixture
def deaf_front_end(monkeypatch):
    monkeypatch.setattr(cbatch.client.session, "SEND_TIMEOUT_S", SEND_TIMEOUT_S)
    with ScriptedFrontEnd(reads=False) as front_end:
        yield front_end


def test_blocking_client_raises_unavailable_when_its_send_times_out(deaf_front_end):
    with Client(deaf_front_end.endpoint) as client:
        first = client.submit(prompt="first")
        started = time.monotonic()
        with pytest.raises(CbatchError) as err:
            while time.monotonic() - started < GIVE_UP_S:
                client.submit(prompt="x" * 1000)
        assert err.value.code == UNAVAILABLE and "took no message" in err.value.message
        with pytest.raises(CbatchError) as waiting:
            list(client.read(first))
        assert waiting.value.code == UNAVAILABLE


def test_async_client_raises_unavailable_when_its_send_times_out(deaf_front_end):
    async def main():
        async with await AsyncClient.connect(deaf_front_end.endpoint) as client:
            first = client.submit(prompt="first")
            reader = asyncio.create_task(client.generate(prompt="waits"))
            started = time.monotonic()
            with pytest.raises(CbatchError) as err:
                while time.monotonic() - started < GIVE_UP_S:
                    client.submit(prompt="x" * 1000)
                    await asyncio.sleep(0)  # the loop runs the send timeout's timer
            assert err.value.code == UNAVAILABLE and "took no message" in err.value.message
            with pytest.raises(CbatchError) as waiting:
                await asyncio.wait_for(reader, 1.0)
            assert waiting.value.code == UNAVAILABLE
            with pytest.raises(CbatchError) as read_err:
                async for _ in client.read(first):
                    pass
            assert read_err.value.code == UNAVAILABLE

    asyncio.run(main())
