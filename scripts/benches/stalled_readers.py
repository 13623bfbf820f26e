"""A bystander's time to first token beside callers that stopped reading their streams.

One daemon (--parallel P, --park-after S, --http). First the idle figure: --probes
streamed requests one after another, each timed from its submit to its first token. Then,
twice, P long streams fill every slot and nobody reads them: first from a ZeroMQ client
that submits and never reads (the client library pauses a request at 4,096 untaken
tokens), then from SSE sockets kept open and never read (what `curl -N ... | sleep 9999`
does; 20 log-probabilities a token fill the buffers sooner). Once the daemon shows every
slot paused, the same probes run again. A probe that finds every slot held waits until the
daemon parks a paused request (paused longer than --park-after with others waiting), so
the target is each probe's time to first token at most 2 x the idle median plus the park
bound. Then the stalled streams are read to their end: each must hold every token.
One table, a row for the idle daemon and one per kind of stalled reader: the probes' first,
median and longest time to first token, the parks, and how many stalled streams held every
token once read; then notes: the target and its verdicts, and the script's own CPU (it
shares the host with the daemon).

    .venv/bin/python scripts/make_tiny_model.py /tmp/tiny.gguf
    .venv/bin/python scripts/bench.py stalled_readers --model /tmp/tiny.gguf
"""

import asyncio
import json
import resource
import socket
import statistics
import threading
import time

import httpx

from benches.options import bench_parser
from benches.peers import CbatchDaemon, free_port
from benches.report import Table, note
from cbatch.client import AsyncClient, Client
from cbatch.model import resolve_model_path

PAUSE_WAIT_S = 600.0  # for every stalled stream to fill its buffers and pause
HTTP_WAIT_S = 60.0


def probe_ttfts(client: Client, num_probes: int) -> list[float]:
    """Seconds from submit to first token of sequential streamed probes."""
    ttfts = []
    for i in range(num_probes):
        started = time.perf_counter()
        chunks = client.stream(prompt=f"a bystander {i}", max_tokens=8, temperature=0, ignore_eos=True)
        next(chunks)
        ttfts.append(time.perf_counter() - started)
        for _ in chunks:
            pass
    return ttfts


def wait_paused(client: Client, num_paused: int) -> None:
    deadline_s = time.monotonic() + PAUSE_WAIT_S
    while client.stats()["num_paused"] < num_paused:
        if time.monotonic() > deadline_s:
            raise RuntimeError("the stalled streams were never all paused")
        time.sleep(0.05)


class ZmqStalls:
    """Streams submitted by an asyncio client that never reads them (its loop runs on, busy
    elsewhere, in a thread of its own), until finish()."""

    def __init__(self, endpoint: str, count: int, max_tokens: int):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        async def submit_all() -> tuple[AsyncClient, list]:  # on the loop's thread, as every call of its client
            client = await AsyncClient.connect(endpoint)
            return client, [client.submit(prompt=f"never read {i}", max_tokens=max_tokens, temperature=0,
                                          ignore_eos=True) for i in range(count)]
        self.client, self.streams = self._run(submit_all())

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(PAUSE_WAIT_S)

    def finish(self) -> list[int]:
        """Read every stream to its end; the tokens each held."""
        async def read_all() -> list[int]:
            counts = []
            for stream in self.streams:
                counts.append(sum([len(chunk.token_ids) async for chunk in self.client.read(stream)]))
            await self.client.close()
            return counts
        counts = self._run(read_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        return counts


class SseStalls:
    """SSE completions whose sockets stay open, unread, until finish()."""

    def __init__(self, port: int, count: int, max_tokens: int):
        body = json.dumps({"prompt": "a stalled reader", "max_tokens": max_tokens, "stream": True,
                           "ignore_eos": True, "temperature": 0, "logprobs": 20}).encode()
        self.sockets = []
        for _ in range(count):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            self.sockets.append(sock)

    def finish(self) -> list[int]:
        counts = []
        for sock in self.sockets:
            received = bytearray()
            sock.settimeout(PAUSE_WAIT_S)
            while not received.endswith(b"data: [DONE]\n\n") and not received.endswith(b"0\r\n\r\n"):
                data = sock.recv(1 << 20)
                if not data:
                    break
                received += data
            sock.close()
            events = [json.loads(line[6:]) for line in received.decode(errors="replace").split("\n")
                      if line.startswith("data: {")]
            counts.append(sum(len(event["choices"][0]["logprobs"]["tokens"]) for event in events
                              if event["choices"] and event["choices"][0].get("logprobs")))
        return counts



def main(argv=None) -> None:
    parser = bench_parser(__doc__, parallel=4)
    parser.add_argument("--park-after", type=float, default=5.0, help="the daemon's --park-after, seconds")
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--stall-tokens", type=int, default=12000, help="max_tokens of each stalled stream")
    args = parser.parse_args(argv)
    port = free_port()
    daemon = CbatchDaemon(resolve_model_path(args.model), args.parallel,
                          ["-q", "--park-after", str(args.park_after), "--ctx-size",
                           str(args.parallel * (args.stall_tokens + 256)), "--http", f"127.0.0.1:{port}"])
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        deadline_s = time.monotonic() + HTTP_WAIT_S
        while httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code != 200:
            if time.monotonic() > deadline_s:
                raise RuntimeError("the HTTP server did not come up")
            time.sleep(0.2)
        with Client(daemon.endpoint) as client:
            ttfts = Table(f"time to first token of {args.probes} probes beside {args.parallel} stalled readers",
                          "stalled readers", "first ms", "median ms", "max ms", "parks", "streams whole")
            idle = probe_ttfts(client, args.probes)
            ttfts.row("none (idle)", idle[0] * 1000, statistics.median(idle) * 1000, max(idle) * 1000, None, None)
            bound_s = 2 * statistics.median(idle) + args.park_after
            verdicts = {}
            for name, stalls in (("zmq", lambda: ZmqStalls(daemon.endpoint, args.parallel, args.stall_tokens)),
                                 ("sse", lambda: SseStalls(port, args.parallel, args.stall_tokens))):
                parks_before = client.stats()["num_parks"]
                stalled = stalls()
                wait_paused(client, args.parallel)
                beside = probe_ttfts(client, args.probes)
                num_parks = client.stats()["num_parks"] - parks_before
                counts = stalled.finish()
                verdicts[name] = "met" if max(beside) <= bound_s else "missed"
                ttfts.row(name, beside[0] * 1000, statistics.median(beside) * 1000, max(beside) * 1000, num_parks,
                          sum(count == args.stall_tokens for count in counts))
            note(f"target: each probe beside stalled readers at most 2 x the idle median + --park-after = "
                 f"{bound_s:.2f} s: " + ", ".join(f"{name} {verdict}" for name, verdict in verdicts.items()))
    finally:
        daemon.stop()
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
    note(f"CPU: the script used {cpu_s:.1f} s")

