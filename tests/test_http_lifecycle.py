"""The HTTP server's life beside the daemon: its port, the model's loading, decode worker
restarts and a server that keeps dying. A real daemon on the tiny model each."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess

import httpx
import openai
import pytest
from daemonkit import SCRIPTS_DIR, pid_alive, wait_until
from httpkit import HttpDaemon, free_port

from cbatch.workers.daemon.child_process import MAX_QUICK_DEATHS

MODEL_ID = "tiny-llama.gguf"


def _error_of(caught) -> dict:
    assert set(caught.value.body) == {"message", "type", "param", "code"}  # OpenAI's error shape
    return caught.value.body


def test_taken_port_ends_the_daemon_before_the_model_loads(tiny_model_path, tmp_path):
    with socket.create_server(("127.0.0.1", free_port())) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run([str(SCRIPTS_DIR / "cbatch-worker"), "-m", tiny_model_path, "--http", str(port),
                                 "--endpoint", f"ipc://{tmp_path}/cbatch.sock"],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1  # as a taken ZeroMQ endpoint
    assert result.stderr.splitlines() == [f"cbatch-worker: cannot listen on http://127.0.0.1:{port}: "
                                          "Address already in use; pass another --http port"]


def test_http_answers_503_while_the_model_loads(tiny_model_path):
    daemon = HttpDaemon(tiny_model_path, is_waited=False)
    try:
        worker_pid = daemon.new_decode_worker_pid()
        os.kill(worker_pid, signal.SIGSTOP)  # caught before its model has loaded, held there
        try:
            reply = httpx.get(f"{daemon.base_url}/health", timeout=30)  # waits in the backlog until served
            assert reply.status_code == 503 and reply.json()["status"] == "starting"
            assert reply.json()["error"]["code"] == "unavailable"
            with pytest.raises(openai.APIStatusError) as caught:
                daemon.openai().completions.create(model=MODEL_ID, prompt="x", max_tokens=2)
            assert caught.value.status_code == 503 and "starting" in _error_of(caught)["message"]
            assert "cbatch-worker ready" not in daemon.log()
            assert "cbatch-worker: loading" in daemon.log()  # said at once, not only when ready
            status = subprocess.run([str(SCRIPTS_DIR / "cbatch-status")], env=daemon.env, capture_output=True,
                                    text=True, timeout=60)
            assert "starting: the decode worker is loading the model" in status.stdout, status.stdout
            assert "worker pid 0" not in status.stdout
        finally:
            os.kill(worker_pid, signal.SIGCONT)
        daemon.wait_http_status(200)
        assert daemon.openai().completions.create(model=MODEL_ID, prompt="x", max_tokens=2).usage.completion_tokens == 2
        assert daemon.stop() == 0
    finally:
        daemon.stop()
        daemon.remove_workdir()


def test_killed_worker_fails_the_request_in_flight_and_health_is_503_until_a_new_one_is_ready(tiny_model_path):
    daemon = HttpDaemon(tiny_model_path, "--parallel", "1")
    try:
        api = daemon.openai(timeout=120)
        with concurrent.futures.ThreadPoolExecutor(1) as pool, daemon.client() as client:
            running = pool.submit(api.completions.create, model=MODEL_ID, prompt="go", max_tokens=100000,
                                  extra_body={"ignore_eos": True})
            wait_until(lambda: client.stats()["num_active"] == 1, 120)
            old_pid = client.health()["worker_pid"]
            os.kill(old_pid, signal.SIGKILL)
            new_pid = daemon.new_decode_worker_pid(old_pid)
            os.kill(new_pid, signal.SIGSTOP)  # the daemon stays without a ready worker while we look
            try:
                with pytest.raises(openai.APIStatusError) as caught:
                    running.result(60)
                assert caught.value.status_code == 503 and _error_of(caught)["code"] == "worker_restarted"
                reply = httpx.get(f"{daemon.base_url}/health", timeout=10)
                assert reply.status_code == 503 and reply.json()["status"] == "starting"
            finally:
                os.kill(new_pid, signal.SIGCONT)
        daemon.wait_http_status(200)
        assert api.completions.create(model=MODEL_ID, prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        daemon.stop()
        daemon.remove_workdir()


def test_a_killed_daemons_http_server_exits_and_frees_the_port(tiny_model_path):
    """SIGKILL leaves the daemon no time to stop its HTTP server, and the server's
    connection to it breaks: the server must not wait to reconnect for ever, holding the
    port a restarted daemon needs (a router's host that is restarted after a crash)."""
    daemon = HttpDaemon(tiny_model_path, "--parallel", "1")
    try:
        server_pids = daemon.http_pids()
        body = {"prompt": "go", "max_tokens": 100000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{daemon.base_url}/v1/completions", json=body, timeout=60) as running:
            lines = running.iter_lines()
            next(lines)
            daemon.process.send_signal(signal.SIGKILL)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"  # the stream ends with an error event, it does not hang
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == "unavailable"
        wait_until(lambda: not any(pid_alive(pid) for pid in server_pids), timeout_s=120)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", daemon.port))
    finally:
        daemon.stop()
        daemon.remove_workdir()


def test_http_server_that_keeps_dying_is_given_up_while_zeromq_is_still_served(tiny_model_path):
    daemon = HttpDaemon(tiny_model_path)
    try:
        for num_killed in range(MAX_QUICK_DEATHS):
            wait_until(lambda: len(daemon.http_pids()) > num_killed, 120)
            os.kill(daemon.http_pids()[-1], signal.SIGKILL)
        wait_until(lambda: "no longer serving HTTP" in daemon.log(), 120)
        assert len(daemon.http_pids()) == MAX_QUICK_DEATHS
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{daemon.base_url}/health", timeout=10)
        with daemon.client() as client:
            assert client.generate(prompt="x", max_tokens=2).usage["completion_tokens"] == 2
        assert daemon.stop() == 0
    finally:
        daemon.stop()
        daemon.remove_workdir()


class _CountingState:
    """Stands in for the server's state: a drain with one response in flight that never ends."""

    def __init__(self):
        self.is_draining = False
        self.num_checks = 0

    @property
    def num_in_flight(self) -> int:
        self.num_checks += 1
        return 1

    async def replace_broken_client(self, keep_trying=lambda: True) -> None:
        pass  # no client here


def test_a_drain_waiting_on_a_response_sleeps_between_checks():
    import asyncio

    import uvicorn

    from cbatch.http_api.server import DRAIN_POLL_S, DrainingServer

    state = _CountingState()
    server = DrainingServer(uvicorn.Config(app=None), state)
    watched_s = 0.5

    async def drain():
        watch = asyncio.create_task(server._watch(os.getppid()))
        await asyncio.sleep(0.05)
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.sleep(watched_s)
        server.should_exit = True
        await asyncio.wait_for(watch, 5)

    asyncio.run(drain())
    # One check per DRAIN_POLL_S (a loaded machine makes fewer): a loop that did not sleep
    # made thousands here, on a core the decode worker needs.
    assert 1 <= state.num_checks <= 2 * watched_s / DRAIN_POLL_S
