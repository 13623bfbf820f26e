"""A hostile line costs only itself: an id with a lone surrogate (JSON's "\\ud800") and a
line nested 1,100 deep are each their line's error in a batch job of the Batches API and in
cbatch-submit, the job completes with the other lines answered, and the next job runs."""

import json
import subprocess

import pytest
from daemonkit import SCRIPTS_DIR, serve_module, wait_until
from httpkit import HttpDaemon

JOB_TIMEOUT_S = 180.0
FINAL = ("completed", "failed", "expired", "cancelled")
NESTED = "[" * 1100 + "]" * 1100


def openai_line(custom_id: str) -> str:
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


# Six lines: the third's custom_id is a lone surrogate, the fifth nests 1,100 deep.
HOSTILE = [openai_line("a"), openai_line("b"), openai_line("\ud800"), openai_line("d"),
           '{"custom_id": "e", "body": ' + NESTED + "}", openai_line("f")]


@pytest.fixture(scope="module")
def daemon(tiny_tools_model_path):
    yield from serve_module(HttpDaemon(tiny_tools_model_path, "--parallel", "2", "--alias", "m"))


def run_job(api, text: str):
    file_id = api.files.create(file=("in.jsonl", text.encode()), purpose="batch").id
    batch = api.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: api.batches.retrieve(batch.id).status in FINAL, JOB_TIMEOUT_S, poll_s=0.1)
    return api.batches.retrieve(batch.id)


def test_hostile_lines_are_their_own_errors_and_the_next_job_runs(daemon):
    api = daemon.openai()
    batch = run_job(api, "\n".join(HOSTILE) + "\n")
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 2)
    answered = [json.loads(line)["custom_id"] for line in api.files.content(batch.output_file_id).text.splitlines()]
    assert answered == ["a", "b", "d", "f"]
    errors = [json.loads(line) for line in api.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(e["error"]["message"].split(" ", 2)[1] for e in errors) == ["3", "5"]  # "line N ..."
    assert any("lone surrogate" in e["error"]["message"] for e in errors)
    assert any("too deep" in e["error"]["message"] for e in errors)
    after = run_job(api, openai_line("next") + "\n")
    assert after.status == "completed" and after.request_counts.completed == 1


def test_cbatch_submit_answers_the_other_lines(daemon, tmp_path):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(HOSTILE) + "\n")
    done = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(source), "-o", str(output)], env=daemon.env,
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr  # some lines failed: exit 1
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 6
    assert [row["custom_id"] for row in rows if row.get("error") is None] == ["a", "b", "d", "f"]
