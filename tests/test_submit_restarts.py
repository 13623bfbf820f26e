"""cbatch-submit loses no line to a daemon that drains and is restarted (a rolling
restart), to a decode worker that restarts, or to a full queue: a line refused for a
moment is held and sent again, never written as a result; every id is answered once."""

import json
import os
import signal
import subprocess
import time

import pytest

from daemonkit import SCRIPTS_DIR, wait_until
from cbatch.errors import EXIT_OK, EXIT_UNREACHABLE

SUBMIT = str(SCRIPTS_DIR / "cbatch-submit")
NUM_LINES = 1500  # thousands of lines went as errors through the drain's refusal window before
TRANSIENT_CODES = {"shutting_down", "worker_restarted", "queue_full", "unavailable"}
DAEMON_ARGS = ("--parallel", "4", "--threads", "1")
WAIT_S = 120.0


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


@pytest.mark.parametrize("make_line", [_native, _openai], ids=["native", "openai"])
def test_a_rolling_restart_of_the_daemon_loses_no_line(start_daemon, tiny_model_path, tmp_path, make_line):
    daemon = start_daemon(tiny_model_path, *DAEMON_ARGS)
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = _write_lines(prompts, make_line, NUM_LINES)
    submitter = subprocess.Popen([SUBMIT, str(prompts), "-o", str(output), "--max-in-flight", "64"],
                                 env=daemon.env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _written_at_least(output, 50), timeout_s=WAIT_S)
        daemon.process.send_signal(signal.SIGTERM)  # it drains: refuses new requests, finishes the running ones
        assert daemon.process.wait(WAIT_S) == 0
        num_before = len(_results(output))
        again = start_daemon(tiny_model_path, *DAEMON_ARGS, workdir=daemon.workdir, endpoint=daemon.endpoint)
        _, stderr = submitter.communicate(timeout=WAIT_S)
    finally:
        submitter.kill()
        submitter.wait()
    assert submitter.returncode == EXIT_OK, stderr
    _check_every_id_once(output, ids)
    assert num_before < NUM_LINES // 2  # most lines were left for the restarted daemon
    with again.client() as client:
        assert client.stats()["num_requests_ended"] >= NUM_LINES - num_before  # the rest ran on the new daemon
