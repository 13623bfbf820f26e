"""cbatch-submit --url: a batch file through one daemon's OpenAI HTTP endpoint gives the
result lines a ZeroMQ run gives, retries a full daemon's 429s until it is served, sends
the API key, and fails clearly when nothing answers. (Through a router: test_scale_out.)"""

import http.server
import json
import socket
import subprocess
import threading
import time

import httpx
import pytest
from common import GREEDY, free_port, without_cached
from daemonkit import SCRIPTS_DIR, serve_module
from httpkit import HttpDaemon

from cbatch.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE

KEY = "submit-test-key"
SUBMIT = str(SCRIPTS_DIR / "cbatch-submit")


@pytest.fixture(scope="module")
def daemon(tiny_model_path, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY + "\n")
    # capacity 2 (1 running, 1 waiting): more in flight is a 429
    made = HttpDaemon(tiny_model_path, "--parallel", "1", "--max-queue", "1", "--threads", "1",
                      "--api-key-file", str(key_file))
    made.key_file = key_file
    yield from serve_module(made)


def _submit(daemon, lines: list, tmp_path, *flags: str, name: str = "out") -> tuple[subprocess.CompletedProcess, list]:
    prompts, output = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.jsonl"
    prompts.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))
    result = subprocess.run([SUBMIT, str(prompts), "-o", str(output), *flags], env=daemon.env, capture_output=True,
                            text=True, timeout=300)
    written = [_counted(json.loads(line)) for line in output.read_text().splitlines()] if output.exists() else []
    return result, written


def _counted(line: dict) -> dict:
    """A result line with its usages' cache-independent counts (a second run finds the
    first one's prompts cached)."""
    if "usage" in line:
        line["usage"] = without_cached(line["usage"])
    for choice in line.get("choices", ()):
        if "usage" in choice:
            choice["usage"] = without_cached(choice["usage"])
    return line


def _over_http(daemon, *flags: str) -> tuple[str, ...]:
    return ("--url", f"{daemon.base_url}/v1", "--api-key-file", str(daemon.key_file), *flags)


NATIVE_LINES = [
    {"id": "plain", "prompt": "one", "max_tokens": 6, **GREEDY},
    {"id": "choices", "prompt": "two", "max_tokens": 5, "n": 2, "seed": 7, "temperature": 0.9},
    {"id": "logprobs", "prompt": "three", "max_tokens": 3, "logprobs": 2, **GREEDY},
    {"id": "stop", "prompt": "four", "max_tokens": 8, "stop": ["e"], "temperature": 0},
    "not json\n",
    {"id": "bad", "prompt": "five", "max_tokens": 4, "top_k": -1},
]


def test_a_file_over_http_gives_the_lines_a_zeromq_run_gives(daemon, tmp_path):
    over_zeromq, expected = _submit(daemon, NATIVE_LINES, tmp_path, "--max-in-flight", "1", name="zeromq")
    over_http, written = _submit(daemon, NATIVE_LINES, tmp_path, *_over_http(daemon, "--max-in-flight", "1"),
                                 name="http")
    assert over_zeromq.returncode == over_http.returncode == EXIT_FAILED  # the two bad lines
    assert written == expected
    assert [line.get("id") for line in written] == ["plain", "choices", "logprobs", "stop", 5, "bad"]
    assert written[5]["error"]["code"] == "invalid_request"


REFUSED_NATIVE_LINES = [
    {"id": "ok", "prompt": "one", "max_tokens": 3, **GREEDY},
    {"id": "unknown", "prompt": "two", "max_tokens": 3, "colour": "blue"},
    {"id": "both", "prompt": "three", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    {"id": "too-many", "prompt": "four", "n": 99},
    {"id": "bad-tools", "messages": [{"role": "user", "content": "hi"}], "tools": "none", "max_tokens": 3},
    {"id": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},  # the model has no template
    {"id": "two", "prompt": "five", "max_tokens": 3, "n": 2, "seed": 3},
    {"id": "ok", "prompt": "again", "max_tokens": 3},
]


def _verdicts(written: list) -> list:
    return [(line["id"], line["error"]["code"] if "error" in line else None) for line in written]


def test_a_native_line_gets_the_same_verdict_over_http_as_over_zeromq(daemon, tmp_path):
    """cbatch's server takes what it does not know in an OpenAI request: a native line is
    checked by the daemon's own parsing before it goes over --url."""
    over_zeromq, expected = _submit(daemon, REFUSED_NATIVE_LINES, tmp_path, "--max-in-flight", "1", name="zeromq")
    over_http, written = _submit(daemon, REFUSED_NATIVE_LINES, tmp_path, *_over_http(daemon, "--max-in-flight", "1"),
                                 name="http")
    assert over_zeromq.returncode == over_http.returncode == EXIT_FAILED
    assert _verdicts(written) == _verdicts(expected) == [
        ("ok", None), ("unknown", "invalid_request"), ("both", "invalid_request"), ("too-many", "invalid_request"),
        ("bad-tools", "invalid_request"), ("chat", "invalid_request"), ("two", None), (8, "invalid_request")]
    assert written == expected  # the same messages, and the same greedy texts


def test_an_openai_batch_file_over_http(daemon, tmp_path):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"q {i}", "max_tokens": 4, "temperature": 0, "logprobs": 1}}
             for i in range(3)]
    zeromq, expected = _submit(daemon, lines, tmp_path, "--max-in-flight", "1", name="zeromq")  # no 429 to retry
    http, written = _submit(daemon, lines, tmp_path, *_over_http(daemon), name="http")
    assert zeromq.returncode == http.returncode == EXIT_OK, http.stderr
    for got, want in zip(written, expected, strict=True):
        assert got["custom_id"] == want["custom_id"] and got["response"]["status_code"] == 200
        assert got["response"]["body"]["choices"] == want["response"]["body"]["choices"]
        assert got["response"]["body"]["usage"] == want["response"]["body"]["usage"]


def test_a_full_daemons_429s_are_retried_until_it_serves_them(daemon, tmp_path):
    def num_refused() -> float:
        metrics = httpx.get(f"{daemon.base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.text.splitlines()
                   if line.startswith("cbatch_http_errors") and 'code="queue_full"' in line)

    refused_before = num_refused()
    lines = [{"id": i, "prompt": f"busy {i}", "max_tokens": 40, **GREEDY} for i in range(6)]
    result, written = _submit(daemon, lines, tmp_path, *_over_http(daemon, "--max-in-flight", "6"))
    assert result.returncode == EXIT_OK, result.stderr
    assert [line["usage"]["completion_tokens"] for line in written] == [40] * 6
    assert num_refused() > refused_before  # 6 in flight against room for 2: some were 429 first


def test_the_key_is_required_and_a_silent_endpoint_is_unreachable(daemon, tmp_path):
    lines = [{"prompt": "x", "max_tokens": 2}]
    refused, _ = _submit(daemon, lines, tmp_path, "--url", f"{daemon.base_url}/v1", "--api-key", "wrong")
    assert refused.returncode == EXIT_FAILED and "a valid API key is needed" in refused.stderr
    nobody, _ = _submit(daemon, lines, tmp_path, "--url", f"http://127.0.0.1:{free_port()}/v1")
    assert nobody.returncode == EXIT_UNREACHABLE and "nothing answers at" in nobody.stderr


def test_a_silent_endpoint_ends_the_run_with_a_clear_error(tmp_path):
    """An endpoint that takes the connection and never answers: the first request (GET
    models) gives up after --request-timeout."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    with socket.socket() as listener:  # the kernel completes the connection; nothing reads it
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        started_s = time.monotonic()
        result = subprocess.run([SUBMIT, str(tmp_path / "in.jsonl"), "--url", url, "--request-timeout", "2"],
                                capture_output=True, text=True, timeout=60)
        took_s = time.monotonic() - started_s
    assert result.returncode == EXIT_UNREACHABLE
    assert result.stderr.strip() == f"cbatch-submit: nothing answers at {url}/: GET models: no answer within 2 s"
    assert took_s < 20


class _ScriptedServer(http.server.BaseHTTPRequestHandler):
    """Lists a model; answers each completion with the server's next scripted answer,
    (status, body), or never (None) until the server closes; then with a completion."""

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self):
        answer = self.server.answers.pop(0) if self.server.answers else (200, {
            "choices": [{"text": "ok", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
        if answer is None:
            self.server.closing.wait()
        else:
            self._send(*answer)

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _submit_to_scripted(tmp_path, answers: list, *flags: str) -> subprocess.CompletedProcess:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedServer)
    server.answers, server.closing = answers, threading.Event()
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        return subprocess.run([SUBMIT, str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--url", url,
                               *flags], capture_output=True, text=True, timeout=60)
    finally:
        server.closing.set()
        server.shutdown()
        serving.join()
        server.server_close()


def test_a_routers_500_is_sent_again_before_it_is_a_result(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    gone = (500, {"error": "upstream connection refused"})  # as a router answers for a daemon that just exited
    result = _submit_to_scripted(tmp_path, [gone, gone, gone, gone], "--max-in-flight", "1")
    assert result.returncode == EXIT_FAILED, result.stderr
    a, b = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert a["error"] == {"code": "internal", "message": "upstream connection refused"}  # the third 500 of a
    assert b["text"] == "ok"  # the fourth 500 was b's first: sent again


def test_an_endpoint_that_never_answers_a_completion_stops_the_run_unwritten(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    output = tmp_path / "out.jsonl"
    result = _submit_to_scripted(tmp_path, [None] * 20, "--request-timeout", "1", "--retry-for", "2")
    assert result.returncode == EXIT_UNREACHABLE
    assert result.stderr.strip() == (f"cbatch-submit: interrupted: 0 of 2 lines written to {output}; rerun with "
                                     "--resume (nothing answered for 2 s, --retry-for: no answer within 1 s)")
    assert output.read_text() == ""


@pytest.mark.parametrize("flags, message", [
    (("--url", "http://127.0.0.1:1/v1", "--endpoint", "ipc:///x"), "--endpoint cannot be used with it"),
    (("--api-key", "k"), "--api-key needs --url"),
    (("--url", "ftp://host/v1"), "--url must start with http:// or https://"),
])
def test_flags_of_the_two_ways_in_do_not_mix(tmp_path, flags, message):
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    result = subprocess.run([SUBMIT, str(tmp_path / "in.jsonl"), *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_USAGE and message in result.stderr
