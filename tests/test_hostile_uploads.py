"""Property: whatever file a caller uploads (odd encodings and line ends, nesting, wrong
shapes of every field, repeated ids, blank lines, long lines) costs only itself. The upload
is refused with a stable code and leaves nothing behind, or its job completes with one
answer or one error per line and every good line answered; the job runner and the decode
worker keep their pids and the next plain job runs. Drawn files go through a real daemon's
Files and Batches APIs."""

import json

import httpx
import pytest
from daemonkit import child_pids, serve_module, wait_until
from httpkit import HttpDaemon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NUM_EXAMPLES = 25
JOB_TIMEOUT_S = 180.0
FINAL = ("completed", "failed", "expired", "cancelled")
ENDPOINTS = {"/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 3, "temperature": 0},
             "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                      "temperature": 0}}
NESTED = "[" * 1100 + "]" * 1100
# Wrong shapes of a line's fields, put over a good line: (path, value); a path of one name is the line's.
WRONG_FIELDS = [(("body",), []), (("body",), "text"), (("body",), None), (("body", "prompt"), 123),
                (("body", "max_tokens"), "many"), (("body", "max_tokens"), -1), (("body", "messages"), "hi"),
                (("body", "messages"), [{"role": "wizard", "content": "hi"}]),
                (("body", "messages"), [{"role": "user", "content": 7}]), (("body", "temperature"), [1]),
                (("body", "n"), 10 ** 9), (("body", "tools"), [{"type": "function"}]),
                (("body", "response_format"), {"type": "json_schema", "json_schema": {"schema": 5}}),
                (("body", "model"), "not-served"), (("body", "stop"), {"x": 1}), (("url",), "/v1/embeddings"),
                (("url",), 7), (("method",), "GET"), (("custom_id",), 12), (("custom_id",), "\ud800"),
                (("body", "prompt"), "x" * 200_000), (("body", "junk"), NESTED)]


def _good(endpoint: str, custom_id: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": dict(ENDPOINTS[endpoint])}


def _wrong(endpoint: str, custom_id: str, path: tuple, value) -> dict:
    line = _good(endpoint, custom_id)
    target = line
    for name in path[:-1]:
        target = target[name]
    target[path[-1]] = value
    return line


@st.composite
def _files(draw):
    """(endpoint, file bytes, the custom_ids of its good lines, whether every line is UTF-8)."""
    endpoint = draw(st.sampled_from(sorted(ENDPOINTS)))
    lines, good_ids = [], []
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["good", "good", "wrong", "wrong", "repeat", "raw"]))
        if kind == "good" or (kind == "repeat" and not good_ids):
            good_ids.append(f"id-{i}")
            lines.append(json.dumps(_good(endpoint, f"id-{i}")).encode())
        elif kind == "repeat":  # an id seen before: refused, the first answered
            lines.append(json.dumps(_good(endpoint, draw(st.sampled_from(good_ids)))).encode())
        elif kind == "wrong":
            path, value = draw(st.sampled_from(WRONG_FIELDS))
            lines.append(json.dumps(_wrong(endpoint, f"id-{i}", path, value)).encode())
        else:
            lines.append(draw(st.sampled_from([b"{", b"not json", b"[]", b"null", b"{}", b'{"custom_id": "x"}',
                                               b'{"custom_id": "e", "body": ' + NESTED.encode() + b"}", b"   ",
                                               "\u00e9t\u00e9".encode("latin-1"), b"\xef\xbb\xbf{}"])))
    ending = draw(st.sampled_from([b"\n", b"\r\n"]))
    text = draw(st.sampled_from([b"", b"\xef\xbb\xbf"])) + ending.join(lines) + draw(st.sampled_from([b"", ending]))
    try:
        text.decode("utf-8")
        is_utf8 = True
    except UnicodeDecodeError:
        is_utf8 = False
    return endpoint, text, good_ids, is_utf8


def _pids(daemon) -> tuple[int, int]:
    """(the decode worker's pid, the job runner's)."""
    runner = [pid for pid in child_pids(daemon.process.pid)
              if b"cbatch.jobs.job_runner" in open(f"/proc/{pid}/cmdline", "rb").read()]
    return daemon.new_decode_worker_pid(), runner[0]


@pytest.fixture(scope="module")
def daemon(tiny_tools_model_path):
    yield from serve_module(HttpDaemon(tiny_tools_model_path, "--parallel", "2", "--alias", "m"))


def _run(http: httpx.Client, endpoint: str, text: bytes) -> tuple[httpx.Response, dict | None]:
    uploaded = http.post("/v1/files", files={"file": ("in.jsonl", text)}, data={"purpose": "batch"})
    if uploaded.status_code != 200:
        return uploaded, None
    created = http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": endpoint,
                                             "completion_window": "24h"})
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    wait_until(lambda: http.get(f"/v1/batches/{batch_id}").json()["status"] in FINAL, JOB_TIMEOUT_S, poll_s=0.1)
    return uploaded, http.get(f"/v1/batches/{batch_id}").json()


@settings(max_examples=NUM_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(drawn=_files())
def test_a_hostile_upload_costs_only_itself(daemon, drawn):
    endpoint, text, good_ids, is_utf8 = drawn
    pids = _pids(daemon)
    with httpx.Client(base_url=daemon.base_url, timeout=60) as http:
        num_files = len(http.get("/v1/files").json()["data"])
        uploaded, batch = _run(http, endpoint, text)
        if batch is None:  # refused whole: a stable code, and no file made
            assert not is_utf8 or not text.strip(b"\xef\xbb\xbf\r\n "), uploaded.text
            assert uploaded.status_code == 400 and uploaded.json()["error"]["code"] == "invalid_request"
            assert len(http.get("/v1/files").json()["data"]) == num_files
        else:
            assert batch["status"] == "completed", batch
            counts = batch["request_counts"]
            assert counts["completed"] + counts["failed"] == counts["total"] >= len(good_ids)
            answered = [] if batch["output_file_id"] is None else [
                json.loads(line)["custom_id"]
                for line in http.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()]
            assert set(good_ids) <= set(answered) and len(answered) == len(set(answered))
        plain = json.dumps(_good(endpoint, "plain")).encode() + b"\n"
        _, after = _run(http, endpoint, plain)
        assert after["status"] == "completed" and after["request_counts"]["completed"] == 1
    assert _pids(daemon) == pids


def test_an_upload_without_its_length_is_refused_once_past_the_limit_not_after_it_is_spooled(daemon):
    """A chunked upload (no Content-Length) is answered 400 as soon as it passes the 200 MB
    limit: the server does not wait for the end of a body that may never end."""
    import select
    import socket
    from urllib.parse import urlsplit

    from cbatch.jobs.files import MAX_FILE_BYTES

    url = urlsplit(daemon.base_url)
    boundary = "b0undary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\n"
            f"Content-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n\r\n").encode()
    line = json.dumps(_good("/v1/completions", "x")).encode() + b"\n"
    chunk = line * (1024 * 1024 // len(line))
    num_sent = 0
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: {url.hostname}\r\nTransfer-Encoding: chunked\r\n"
                     f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode())
        for data in [head] + [chunk] * (2 * MAX_FILE_BYTES // len(chunk)):
            if select.select([sock], [], [], 0)[0]:  # answered: it stopped reading
                break
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))
            except (BrokenPipeError, ConnectionResetError):
                break
            num_sent += len(data)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            ready = select.select([sock], [], [], 60)[0]
            received = sock.recv(65536) if ready else b""
            if not received:
                break
            answer += received
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b'"invalid_request"' in answer and b"200 MB" in answer
    assert num_sent < 1.5 * MAX_FILE_BYTES  # answered long before the body's end
