"""Several HTTP server processes on one port: all serve, a killed one is replaced while
the others keep serving, and /metrics from any of them counts the requests of all."""

import concurrent.futures
import os
import re
import signal

import httpx
from daemonkit import wait_until
from httpkit import HttpDaemon

NUM_REQUESTS = 24


def completion(base_url: str, i: int) -> dict:
    response = httpx.post(f"{base_url}/v1/completions", timeout=60.0,
                          json={"prompt": f"request {i}", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def run_concurrently(base_url: str, first: int) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda i: completion(base_url, i), range(first, first + NUM_REQUESTS)))


def served_requests(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    return sum(float(value) for value in re.findall(r'^cbatch_http_requests_total\{[^}]*\} (\S+)$', text, re.M))


def test_several_http_processes_serve_one_port_and_a_killed_one_is_replaced(tiny_model_path):
    daemon = HttpDaemon(tiny_model_path, "--parallel", "4", "--http-processes", "2")
    try:
        wait_until(lambda: len(daemon.http_pids()) == 2, timeout_s=120)
        first_pids = daemon.http_pids()
        assert all(r["usage"]["completion_tokens"] == 8 for r in run_concurrently(daemon.base_url, 0))
        assert served_requests(daemon.base_url) == NUM_REQUESTS  # whichever process answers the scrape

        os.kill(first_pids[0], signal.SIGKILL)
        # The other process keeps the port served while the killed one restarts.
        assert all(r["usage"]["completion_tokens"] == 8 for r in run_concurrently(daemon.base_url, NUM_REQUESTS))
        wait_until(lambda: len(daemon.http_pids()) == 3, timeout_s=120)
        assert daemon.http_pids()[2] not in first_pids
        daemon.wait_http_status(200)
        assert served_requests(daemon.base_url) == 2 * NUM_REQUESTS  # the dead process's counts are kept
        assert daemon.stop() == 0
        assert daemon.leftovers() == []
    finally:
        daemon.stop()
        daemon.remove_workdir()


def test_a_folder_named_cbatch_where_the_daemon_starts_is_not_imported(tiny_model_path, tmp_path, start_http_daemon):
    """The HTTP servers and the job runner start as `python -m`: beside a source checkout,
    or any folder named cbatch, they must import the package the daemon runs, not it."""
    decoy = tmp_path / "cbatch"
    decoy.mkdir()
    (decoy / "__init__.py").write_text('raise ImportError("the cbatch folder in the working directory was imported")\n')
    d = start_http_daemon(tiny_model_path, "--parallel", "2", prefix=("env", "-C", str(tmp_path)))
    reply = httpx.post(f"{d.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert "was imported" not in d.log()
