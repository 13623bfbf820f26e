"""cbatch-submit stopped mid-file (SIGTERM or Ctrl-C) keeps every line it finished, says so
in one line, and --resume then runs only the rest."""

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest
from common import default_sigint
from daemonkit import SCRIPTS_DIR

from cbatch.errors import EXIT_INTERRUPTED

NUM_LINES = 40
WAIT_S = 60.0
RETRY_FOR_S = 2


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_run_keeps_its_lines_and_resume_finishes(start_daemon, tiny_model_path, tmp_path,
                                                                 stop_signal):
    daemon = start_daemon(tiny_model_path, "--parallel", "2")
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "go", "max_tokens": 200, "ignore_eos": True})
                               + "\n" for i in range(NUM_LINES)))
    command = [str(SCRIPTS_DIR / "cbatch-submit"), str(prompts), "-o", str(output), "--max-in-flight", "2"]
    process = subprocess.Popen(command, env=daemon.env, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and (not output.exists() or output.read_text().count("\n") < 3):
        time.sleep(0.02)  # native results are written (and flushed) as their turn comes
    process.send_signal(stop_signal)
    _, stderr = process.communicate(timeout=WAIT_S)
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert process.returncode == EXIT_INTERRUPTED
    assert stderr.strip() == (f"cbatch-submit: interrupted: {len(written)} of {NUM_LINES} lines written to {output}; "
                              "rerun with --resume")
    assert 3 <= len(written) < NUM_LINES
    assert [line["id"] for line in written] == [f"q{i}" for i in range(len(written))]
    assert all(line["usage"]["completion_tokens"] == 200 for line in written)
    assert _is_idle_soon(daemon)  # the requests still outstanding were cancelled, not left running

    resumed = subprocess.run([*command, "--resume"], env=daemon.env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{NUM_LINES - len(written)} lines written, {NUM_LINES - len(written)} ok" in resumed.stderr
    ids = [json.loads(line)["id"] for line in output.read_text().splitlines()]
    assert ids == [f"q{i}" for i in range(NUM_LINES)]


def _is_idle_soon(daemon) -> bool:
    deadline = time.monotonic() + WAIT_S  # generous: cancels reach a busy daemon late
    with daemon.client() as client:
        while time.monotonic() < deadline:
            if client.stats()["num_in_flight"] == 0:
                return True
            time.sleep(0.05)
    return False


def test_endless_input_against_a_daemon_that_stops_ends_the_run(start_daemon, tiny_model_path, tmp_path):
    """Lines the daemon refuses (it drains, then is gone) must not turn an endless input
    into endless errors: they are held, no more lines are read, and once nothing has been
    answered for --retry-for the run stops, says what it wrote, and exits 3."""
    daemon = start_daemon(tiny_model_path, "--parallel", "2")
    output = tmp_path / "out.jsonl"
    command = (f"yes '{{\"prompt\": \"x\", \"max_tokens\": 1}}' | {SCRIPTS_DIR / 'cbatch-submit'} - -o {output} "
               f"--retry-for {RETRY_FOR_S}")
    process = subprocess.Popen(["bash", "-c", command], env=daemon.env, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # its own process group: the pipeline ends with it
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and (not output.exists() or output.read_text().count("\n") < 50):
        time.sleep(0.05)
    assert daemon.stop() == 0
    try:
        _, stderr = process.communicate(timeout=WAIT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the whole group may have ended already
            os.killpg(process.pid, signal.SIGKILL)  # bash, yes and cbatch-submit, whatever happened
        process.wait()
    assert process.returncode == 3, stderr
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert stderr.strip().startswith(f"cbatch-submit: interrupted: {len(written)} lines written to {output}; "
                                     f"rerun with --resume (nothing answered for {RETRY_FOR_S} s, --retry-for: ")
    assert [line for line in written if "error" in line] == []  # the refused lines were not written
