"""A light HTTP load generator: a closed loop of --clients callers on one thread, raw
non-blocking sockets and pre-built requests, so that the callers cost the host a small
fraction of what the server does (an httpx.Client per thread costs about ten times more
per request and starved the server it measured).

Each caller sends POST --path with the next prompt of --prompts (a JSON list), reads the
whole response (Content-Length or chunked) and sends the next, on a kept-alive connection
or, with --new-connections, a new one per request (as curl and many scripts do). With
--stream it also records the time to the first body bytes (TTFT). Prints one JSON object:
requests, elapsed_s, ttft_s (streamed only), cpu_s (this process, user + system), errors.

    .venv/bin/python scripts/benches/loadgen.py --url http://127.0.0.1:8080 --prompts prompts.json \
        --body '{"max_tokens": 64, "temperature": 0, "ignore_eos": true}' --clients 64 [--stream]
"""

import argparse
import json
import resource
import selectors
import socket
import time
from urllib.parse import urlsplit

MAX_ERRORS = 10  # more failed requests than this and the run stops: its figures would mean nothing


def request_bytes(host: str, path: str, body: dict, is_kept_alive: bool, api_key: str = "") -> bytes:
    payload = json.dumps(body).encode()
    authorization = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{authorization}"
            f"Content-Length: {len(payload)}\r\nConnection: {'keep-alive' if is_kept_alive else 'close'}\r\n\r\n")
    return head.encode() + payload


class Response:
    """An HTTP/1.1 response read incrementally: `feed` returns True once it is complete."""

    def __init__(self):
        self.buffer = bytearray()
        self.status = 0
        self.body_at = -1  # where the body starts in buffer, once the head is read
        self.content_length = -1  # -1: chunked
        self.is_closing = False  # the server closes the connection after this response
        self.chunk_at = 0  # chunked: where the next chunk's size line starts

    def feed(self, data: bytes) -> bool:
        self.buffer += data
        if self.body_at < 0:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return False
            head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            self.status = int(head[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
            self.content_length = int(headers.get("content-length", -1))
            self.is_closing = headers.get("connection", "").lower() == "close"
            self.body_at = self.chunk_at = end + 4
        if self.content_length >= 0:
            return len(self.buffer) - self.body_at >= self.content_length
        while True:  # chunked: walk the complete chunks; a zero-size one ends the body
            line_end = self.buffer.find(b"\r\n", self.chunk_at)
            if line_end < 0:
                return False
            size = int(bytes(self.buffer[self.chunk_at:line_end]).split(b";")[0], 16)
            chunk_end = line_end + 2 + size + 2
            if len(self.buffer) < chunk_end:
                return False
            if size == 0:
                return True
            self.chunk_at = chunk_end

    @property
    def has_body_bytes(self) -> bool:
        return self.body_at >= 0 and len(self.buffer) > self.body_at


class Caller:
    def __init__(self, address, requests: list[bytes], is_kept_alive: bool):
        self.address, self.requests, self.is_kept_alive = address, requests, is_kept_alive
        self.sock: socket.socket | None = None
        self.request = b""  # the one in flight
        self.response = Response()
        self.sent_s = 0.0
        self.ttft_s: float | None = None

    def connect(self) -> socket.socket:
        self.sock = socket.create_connection(self.address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        return self.sock

    def send_next(self) -> None:
        self.response, self.ttft_s = Response(), None
        self.sent_s = time.perf_counter()
        self.sock.setblocking(True)  # a request is a few hundred bytes: it fits the socket's buffer
        self.request = self.requests.pop()
        self.sock.sendall(self.request)
        self.sock.setblocking(False)


def run(args) -> dict:
    url = urlsplit(args.url)
    address = (url.hostname, url.port or 80)
    body = {**json.loads(args.body), "stream": args.stream}
    prompts = json.load(open(args.prompts))
    requests = [request_bytes(url.netloc, args.path, {**body, "prompt": prompt}, not args.new_connections, args.api_key)
                for prompt in prompts]
    shares = [requests[i::args.clients][::-1] for i in range(args.clients)]  # popped from the end
    selector = selectors.DefaultSelector()
    callers = [Caller(address, share, not args.new_connections) for share in shares if share]
    ttfts, num_done, errors = [], 0, []
    started_s, cpu_started = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for caller in callers:
        selector.register(caller.connect(), selectors.EVENT_READ, caller)
        caller.send_next()
    while callers and len(errors) <= MAX_ERRORS:
        for key, _ in selector.select(timeout=60):
            caller: Caller = key.data
            data = caller.sock.recv(1 << 16)
            now_s = time.perf_counter()
            if not data and not caller.response.buffer and caller.is_kept_alive:
                # The server closed the kept-alive connection before this request (llama-server
                # closes one after a few requests): the request goes again on a new one.
                selector.unregister(caller.sock)
                caller.sock.close()
                selector.register(caller.connect(), selectors.EVENT_READ, caller)
                caller.requests.append(caller.request)
                caller.send_next()
                continue
            is_complete = caller.response.feed(data) if data else True
            if caller.ttft_s is None and caller.response.has_body_bytes:
                caller.ttft_s = now_s - caller.sent_s
            if not is_complete:
                continue
            if not data or caller.response.status != 200:
                errors.append(f"status {caller.response.status}: {bytes(caller.response.buffer[-200:])!r}")
            else:
                num_done += 1
                ttfts.append(caller.ttft_s)
            if not caller.is_kept_alive or not data or caller.response.is_closing:
                selector.unregister(caller.sock)
                caller.sock.close()
                if caller.requests:
                    selector.register(caller.connect(), selectors.EVENT_READ, caller)
            if caller.requests:
                caller.send_next()
            else:
                if caller.is_kept_alive and data and not caller.response.is_closing:
                    selector.unregister(caller.sock)
                    caller.sock.close()
                callers.remove(caller)
    elapsed_s = time.perf_counter() - started_s
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    return {"requests": num_done, "elapsed_s": elapsed_s, "ttft_s": ttfts if args.stream else [],
            "cpu_s": cpu.ru_utime + cpu.ru_stime - cpu_started.ru_utime - cpu_started.ru_stime, "errors": errors}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--path", default="/v1/completions")
    parser.add_argument("--prompts", required=True, help="a JSON file: a list of prompt strings")
    parser.add_argument("--body", default="{}", help="JSON fields of every request besides prompt and stream")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--new-connections", action="store_true", help="a new connection per request")
    parser.add_argument("--api-key", default="", help="sent as 'Authorization: Bearer KEY'")
    print(json.dumps(run(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
