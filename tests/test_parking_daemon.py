"""Through a real daemon: callers that stop reading their streams (an asyncio caller busy
elsewhere, an HTTP reader that keeps its socket but reads nothing) do not keep a bystander
from being served: once paused past --park-after with requests waiting, their requests
give their slots back, and resume with every token when their readers read again. While
only paused work is left and the queue waits, the decode worker sleeps."""

import asyncio
import json
import socket
import time

import httpx
from daemonkit import wait_until

from cbatch.client import AsyncClient

NUM_TOKENS = 6000  # past the 4,096 untaken tokens that make the client library pause a request
PARK_AFTER_S = 2.0
BYSTANDER_TIMEOUT_S = 120.0  # generous for a loaded machine; without parking it would never be admitted
LOOK_S = 120.0


def test_streams_nobody_reads_give_their_slots_to_a_bystander_and_lose_nothing(start_daemon, tiny_model_path):
    daemon = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 8000),
                          "--park-after", str(PARK_AFTER_S))

    async def run() -> tuple[list, dict]:
        loop = asyncio.get_running_loop()
        async with await AsyncClient.connect(daemon.endpoint) as stalled, \
                await AsyncClient.connect(daemon.endpoint) as bystander:
            streams = [stalled.submit(prompt=f"never read {i}", max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0)
                       for i in range(2)]
            deadline_s = loop.time() + LOOK_S
            while (await bystander.stats())["num_paused"] < 2:  # both slots held by paused requests
                assert loop.time() < deadline_s, "the unread streams were never paused"
                await asyncio.sleep(0.05)
            answer = await bystander.generate(prompt="a bystander", max_tokens=8, temperature=0,
                                              timeout=BYSTANDER_TIMEOUT_S)
            stats = await bystander.stats()
            chunks = []
            for stream in streams:
                chunks.append([chunk async for chunk in stalled.read(stream)])
            return [answer, chunks], stats

    (answer, chunks), stats = asyncio.run(run())
    assert answer.finish_reason == "length" and len(answer.token_ids) == 8
    assert stats["num_parks"] >= 1
    for stream_chunks in chunks:  # parked, then resumed: every token, once
        assert stream_chunks[-1].finish_reason == "length"
        assert sum(len(chunk.token_ids) for chunk in stream_chunks) == NUM_TOKENS
    with daemon.client() as client:
        wait_until(lambda: client.stats()["num_parked"] == 0, 30)


def worker_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 1/100 s


def test_the_worker_sleeps_while_paused_requests_hold_every_slot_and_others_wait(start_daemon, tiny_model_path):
    daemon = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 8000), "--park-after", "600")
    window_s = 3.0

    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        async with await AsyncClient.connect(daemon.endpoint) as stalled:
            for i in range(2):
                stalled.submit(prompt=f"never read {i}", max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0)
            waiting = stalled.submit(prompt="waits for a slot", max_tokens=8)
            deadline_s = loop.time() + LOOK_S
            while (await stalled.stats())["num_paused"] < 2:
                assert loop.time() < deadline_s, "the unread streams were never paused"
                await asyncio.sleep(0.05)
            stats = await stalled.stats()
            assert stats["num_queued"] == 1 and not waiting.is_done
            pid = (await stalled.health())["worker_pid"]
            cpu_before, started = worker_cpu_s(pid), time.monotonic()
            await asyncio.sleep(window_s)
            return worker_cpu_s(pid) - cpu_before, time.monotonic() - started

    cpu_s, elapsed_s = asyncio.run(run())
    # Stepping empty batches takes a whole core; sleeping, a stats report each half second.
    assert cpu_s < 0.25 * elapsed_s, (cpu_s, elapsed_s)


def test_sse_readers_that_keep_their_sockets_but_read_nothing_do_not_keep_a_bystander_out(start_http_daemon,
                                                                                           tiny_model_path):
    daemon = start_http_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 13000),
                               "--park-after", str(PARK_AFTER_S))
    # Large events (20 log-probabilities a token) fill the kernel's and uvicorn's buffers, then
    # the HTTP server's client holds the untaken tokens until it pauses the request.
    body = json.dumps({"prompt": "a stalled reader", "max_tokens": 12000, "stream": True, "ignore_eos": True,
                       "temperature": 0, "logprobs": 20}).encode()
    stalled = []
    for _ in range(2):  # what `curl -N ... | sleep 9999` does: the socket stays open, nothing is read
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", daemon.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        stalled.append(sock)
    with daemon.client() as client:
        wait_until(lambda: client.stats()["num_paused"] == 2, 2 * LOOK_S)
        answer = httpx.post(f"{daemon.base_url}/v1/completions", json={"prompt": "a bystander", "max_tokens": 8},
                            timeout=BYSTANDER_TIMEOUT_S)
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
        assert client.stats()["num_parks"] >= 1
    for sock in stalled:  # the stalled streams go on once read, to their end
        received = b""
        sock.settimeout(LOOK_S)
        while not received.endswith(b"data: [DONE]\n\n") and not received.endswith(b"0\r\n\r\n"):
            data = sock.recv(1 << 20)
            assert data, "the stream ended before its end"
            received += data
        sock.close()
        events = [json.loads(line[6:]) for line in received.decode(errors="replace").split("\n")
                  if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
