"""cbatch-submit loses no line to a daemon that drains and is restarted (a rolling
restart), to a decode worker that restarts, or to a full queue: a line refused for a
moment is held and sent again, never written as a result; every id is answered once."""

import json
import os
import signal
import subprocess

import pytest
from daemonkit import SCRIPTS_DIR, wait_until

from cbatch.errors import EXIT_OK, EXIT_UNREACHABLE

SUBMIT = str(SCRIPTS_DIR / "cbatch-submit")
NUM_LINES = 1500  # thousands of lines went as errors through the drain's refusal window before
TRANSIENT_CODES = {"shutting_down", "worker_restarted", "queue_full", "unavailable"}
DAEMON_ARGS = ("--parallel", "4", "--threads", "1")
WAIT_S = 120.0
GIVE_UP_S = 2  # --retry-for of a run whose daemon is gone for good


def _native(i: int) -> dict:
    return {"id": f"n{i}", "prompt": f"line {i}", "max_tokens": 2, "temperature": 0}


def _openai(i: int) -> dict:
    return {"custom_id": f"o{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"line {i}", "max_tokens": 2, "temperature": 0}}


def _error_code(result: dict):
    """A result line's error code, native or OpenAI; None for an answer."""
    if "custom_id" in result:
        return result["error"]["code"] if result["error"] else result["response"]["body"].get("error", {}).get("code")
    return result.get("error", {}).get("code")


def _results(output) -> list[dict]:
    return [json.loads(line) for line in output.read_text().splitlines()] if output.exists() else []


def _written_at_least(output, num_lines: int) -> bool:
    return output.exists() and output.read_text().count("\n") >= num_lines


def _check_every_id_once(output, ids: list[str]) -> None:
    results = _results(output)
    got = [result.get("custom_id", result.get("id")) for result in results]
    assert sorted(got) == sorted(ids) and len(set(got)) == len(got)
    assert [code for code in map(_error_code, results) if code is not None] == []


def _write_lines(path, make_line, num_lines: int) -> list[str]:
    lines = [make_line(i) for i in range(num_lines)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return [line.get("custom_id", line.get("id")) for line in lines]


@pytest.mark.parametrize("make_line, over_url", [(_native, False), (_openai, False), (_openai, True)],
                         ids=["native", "openai", "openai-url"])
def test_a_rolling_restart_of_the_daemon_loses_no_line(start_daemon, start_http_daemon, tiny_model_path, tmp_path,
                                                       make_line, over_url):
    start = start_http_daemon if over_url else start_daemon
    daemon = start(tiny_model_path, *DAEMON_ARGS)
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    num_lines = NUM_LINES // 4 if over_url else NUM_LINES  # a request over HTTP costs more
    ids = _write_lines(prompts, make_line, num_lines)
    url = ["--url", f"{daemon.base_url}/v1"] if over_url else []
    again = []

    def restart() -> None:
        daemon.process.send_signal(signal.SIGTERM)  # it drains: refuses new requests, finishes the running ones
        assert daemon.process.wait(WAIT_S) == 0
        # The same endpoint (and HTTP port): as a service manager restarts it.
        port = {"port": daemon.port} if over_url else {}
        again.append(start(tiny_model_path, *DAEMON_ARGS, workdir=daemon.workdir, endpoint=daemon.endpoint, **port))

    result = _run_while(daemon, [str(prompts), "-o", str(output), *url], output, restart)
    assert result.returncode == EXIT_OK, result.stderr
    _check_every_id_once(output, ids)
    with again[0].client() as client:
        assert client.stats()["num_requests_ended"] > 0  # the lines left at the drain ran on the restarted daemon


def test_a_decode_worker_restart_loses_no_line(start_daemon, tiny_model_path, tmp_path):
    daemon = start_daemon(tiny_model_path, *DAEMON_ARGS)
    old_pid = daemon.health["worker_pid"]
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = _write_lines(prompts, _native, NUM_LINES // 2)
    result = _run_while(daemon, [str(prompts), "-o", str(output)], output,
                        lambda: os.kill(old_pid, signal.SIGKILL))  # its running requests end worker_restarted
    assert result.returncode == EXIT_OK, result.stderr
    _check_every_id_once(output, ids)
    with daemon.client() as client:
        assert client.health()["worker_pid"] not in (0, old_pid)


def test_a_full_queue_writes_no_queue_full_line(start_daemon, tiny_model_path, tmp_path):
    daemon = start_daemon(tiny_model_path, "--parallel", "1", "--max-queue", "2", "--threads", "1")
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = _write_lines(prompts, _openai, 150)
    result = subprocess.run([SUBMIT, str(prompts), "-o", str(output), "--max-in-flight", "150"], env=daemon.env,
                            capture_output=True, text=True, timeout=WAIT_S)
    assert result.returncode == EXIT_OK, result.stderr
    _check_every_id_once(output, ids)


@pytest.mark.parametrize("make_line", [_native, _openai], ids=["native", "openai"])
def test_a_run_whose_daemon_stays_gone_writes_no_refusal_and_resume_finishes_it(start_daemon, tiny_model_path,
                                                                                  tmp_path, make_line):
    """No daemon comes back within --retry-for: the run stops, writes none of the refused
    lines and says how to go on; --resume against the restarted daemon answers the rest."""
    daemon = start_daemon(tiny_model_path, *DAEMON_ARGS)
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = _write_lines(prompts, make_line, NUM_LINES // 2)
    stopped = _run_while(daemon, [str(prompts), "-o", str(output), "--retry-for", str(GIVE_UP_S)], output,
                         lambda: daemon.process.send_signal(signal.SIGTERM))
    assert stopped.returncode == EXIT_UNREACHABLE, stopped.stderr
    assert "rerun with --resume" in stopped.stderr
    assert daemon.process.wait(WAIT_S) == 0
    written = _results(output)
    assert 50 <= len(written) < len(ids) and [code for code in map(_error_code, written) if code] == []
    again = start_daemon(tiny_model_path, *DAEMON_ARGS, workdir=daemon.workdir, endpoint=daemon.endpoint)
    resumed = subprocess.run([SUBMIT, str(prompts), "-o", str(output), "--resume"], env=again.env,
                             capture_output=True, text=True, timeout=WAIT_S)
    assert resumed.returncode == EXIT_OK, resumed.stderr
    assert f"{len(ids) - len(written)} ok, 0 failed, {len(written)} skipped" in resumed.stderr
    _check_every_id_once(output, ids)


def _run_while(daemon, args: list[str], output, disrupt) -> subprocess.CompletedProcess:
    """cbatch-submit with args, and disrupt() once it wrote its first lines."""
    submitter = subprocess.Popen([SUBMIT, *args, "--max-in-flight", "64"], env=daemon.env, stderr=subprocess.PIPE,
                                 text=True)
    try:
        wait_until(lambda: _written_at_least(output, 50), timeout_s=WAIT_S)
        disrupt()
        _, stderr = submitter.communicate(timeout=WAIT_S)
    finally:
        submitter.kill()
        submitter.wait()
    return subprocess.CompletedProcess(submitter.args, submitter.returncode, None, stderr)


def test_resume_runs_again_the_lines_an_older_run_wrote_as_transient_errors(start_daemon, tiny_model_path, tmp_path):
    daemon = start_daemon(tiny_model_path, *DAEMON_ARGS)
    for make_line, refused in [
        (_native, {"id": "n1", "error": {"code": "shutting_down", "message": "the daemon is shutting down"}}),
        (_openai, {"id": "batch_req_1", "custom_id": "o1", "error": None, "response": {
            "status_code": 503, "request_id": "r1",
            "body": {"error": {"message": "draining", "type": "service_unavailable", "code": "shutting_down"}}}}),
    ]:
        prompts, output = tmp_path / f"{make_line.__name__}.in.jsonl", tmp_path / f"{make_line.__name__}.jsonl"
        ids = _write_lines(prompts, make_line, 3)
        command = [SUBMIT, str(prompts), "-o", str(output)]
        assert subprocess.run(command, env=daemon.env, capture_output=True, timeout=WAIT_S).returncode == EXIT_OK
        answered = _results(output)
        # As an older cbatch-submit wrote a drain's refusal: a result line, then the next line cut.
        output.write_text("".join(json.dumps(line) + "\n" for line in (answered[0], refused)) + '{"id": "cut')
        resumed = subprocess.run([*command, "--resume"], env=daemon.env, capture_output=True, text=True,
                                 timeout=WAIT_S)
        assert resumed.returncode == EXIT_OK, resumed.stderr
        assert "2 ok, 0 failed" in resumed.stderr  # the refused line and the cut one ran
        _check_every_id_once(output, ids)
        assert _results(output)[0] == answered[0]  # what was answered stays as written
