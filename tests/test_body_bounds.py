"""Request bodies are bounded as they arrive: a body past the bound, declared or sent in
chunks without its length, is answered 413 `too_large` before it is held whole, the HTTP
process's memory stays flat, and a bystander is served as before."""

import json
import socket

import httpx
import pytest
from httpkit import HttpDaemon

from cbatch.http_api.body_limit import DEFAULT_MAX_BODY_BYTES

CHUNK = b"x" * (1 << 20)
HUGE_BYTES = 300 << 20
MAX_RSS_GROWTH_MB = 40  # the bound is ~37 MB: holding a 300 MB body whole would show far more


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    daemon = HttpDaemon(tiny_model_path, "--parallel", "2")
    yield daemon
    daemon.stop()
    daemon.remove_workdir()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def send_raw(port: int, path: str, headers: bytes, chunks) -> bytes:
    """Send a request whose body is `chunks` until the server answers or closes; its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode() + headers
                     + b"\r\n")
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused mid-way: the answer is already there
        received = b""
        try:
            while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
                data = sock.recv(65536)
                if not data:
                    break
                received += data
        except ConnectionResetError:
            pass
        return received


HEAD, TAIL = b'{"messages": [{"role": "user", "content": "', b'"}], "max_tokens": 4}'


def chat_body_chunks(num_bytes: int, is_chunked: bool):
    """A chat body of len(HEAD) + num_bytes + len(TAIL) (one huge message), made as it is sent."""
    parts = [HEAD, *(CHUNK for _ in range(num_bytes // len(CHUNK))), TAIL]
    for part in parts:
        yield f"{len(part):x}\r\n".encode() + part + b"\r\n" if is_chunked else part
    if is_chunked:
        yield b"0\r\n\r\n"


@pytest.mark.parametrize("is_chunked", [False, True], ids=["declared", "chunked"])
def test_a_body_past_the_bound_is_refused_413_before_it_is_held(daemon, is_chunked):
    [http_pid] = daemon.http_pids()
    before_mb = rss_mb(http_pid)
    num_bytes = len(HEAD) + HUGE_BYTES + len(TAIL)
    headers = b"Transfer-Encoding: chunked\r\n" if is_chunked else f"Content-Length: {num_bytes}\r\n".encode()
    answer = send_raw(daemon.port, "/v1/chat/completions", headers, chat_body_chunks(HUGE_BYTES, is_chunked))
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 413 " in status_line, answer[:300]
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "too_large" and "MiB" in body["error"]["message"]
    assert rss_mb(http_pid) - before_mb < MAX_RSS_GROWTH_MB
    bystander = httpx.post(f"{daemon.base_url}/v1/completions", json={"prompt": "still here", "max_tokens": 4},
                           timeout=120)
    assert bystander.status_code == 200 and bystander.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/batches"])
def test_every_endpoint_that_takes_a_body_is_bounded(daemon, path):
    num_bytes = DEFAULT_MAX_BODY_BYTES + 1
    answer = httpx.post(f"{daemon.base_url}{path}", content=b"{" + b" " * (num_bytes - 2) + b"}",
                        headers={"content-type": "application/json"}, timeout=120)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "too_large"
    # Just under the bound it is read (and then judged on what it says).
    answer = httpx.post(f"{daemon.base_url}{path}", content=b"{" + b" " * (DEFAULT_MAX_BODY_BYTES - 2) + b"}",
                        headers={"content-type": "application/json"}, timeout=120)
    assert answer.status_code == 400
