"""A drain whose grace ends under a batch (a rolling restart): the lines it cut end with
shutting_down, which no batch path writes as an answer; each is held and sent again to
the next daemon on the endpoint, so every line is answered once, in full. Through
cbatch-submit with a native file and an OpenAI file over ZeroMQ, an OpenAI file over
--url, and a batch job of the Batches API."""

import json
import signal
import subprocess

import pytest
from daemonkit import SCRIPTS_DIR, wait_until

NUM_LINES = 8
MAX_TOKENS = 800  # the lines outlast the drain's grace of 1 s on the tiny model: it cuts some
JOB_TIMEOUT_S = 300.0


def native_line(i: int) -> dict:
    return {"id": f"n{i}", "prompt": f"line {i}", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def openai_line(i: int) -> dict:
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"line {i}", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}


def answered_in_full(row: dict) -> str:
    """The line's id, after checking its answer is a whole completion."""
    if "custom_id" in row:
        body = row["response"]["body"]
        assert row["error"] is None and body["choices"][0]["finish_reason"] == "length", row
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        return row["custom_id"]
    assert row.get("finish_reason") == "length" and row["usage"]["completion_tokens"] == MAX_TOKENS, row
    return row["id"]


def restart(start_http_daemon, first, args, is_cut: bool = True):
    """SIGTERM to `first` once it runs lines; the next daemon on its endpoint, port and state.
    `is_cut`: the drain's grace ends with lines running (a job's runner is drained first,
    and stops its own lines, to run them on later)."""
    with first.client() as client:
        wait_until(lambda: client.stats()["num_active"] >= 2, timeout_s=120)
    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(120) == 0, first.log()
    assert ("drain grace over: " in first.log()) is is_cut
    return start_http_daemon(*args, port=first.port, workdir=first.workdir)


@pytest.mark.parametrize("kind", ["native", "openai", "openai over --url"])
def test_cbatch_submit_sends_the_lines_a_drain_cut_to_the_next_daemon(start_http_daemon, tiny_model_path, tmp_path,
                                                                      kind):
    args = (tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 2048), "--drain-grace", "1")
    first = start_http_daemon(*args)
    make_line = native_line if kind == "native" else openai_line
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(make_line(i)) + "\n" for i in range(NUM_LINES)))
    url = ["--url", f"{first.base_url}/v1"] if kind.endswith("--url") else []
    submit = subprocess.Popen([str(SCRIPTS_DIR / "cbatch-submit"), str(source), "-o", str(output), *url,
                               "--retry-for", "300"], env=first.env, stderr=subprocess.PIPE, text=True)
    try:
        restart(start_http_daemon, first, args)
        assert submit.wait(timeout=JOB_TIMEOUT_S) == 0, submit.stderr.read()
    finally:
        submit.kill()
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    ids = [answered_in_full(row) for row in rows]
    assert sorted(ids) == sorted(make_line(i).get("id", make_line(i).get("custom_id")) for i in range(NUM_LINES))


def test_a_batch_job_a_drain_cut_finishes_on_the_next_daemon(start_http_daemon, tiny_model_path):
    args = (tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 2048), "--drain-grace", "1")
    first = start_http_daemon(*args)
    lines = "".join(json.dumps(openai_line(i)) + "\n" for i in range(NUM_LINES)).encode()
    api = first.openai()
    batch = api.batches.create(input_file_id=api.files.create(file=("in.jsonl", lines), purpose="batch").id,
                               endpoint="/v1/completions", completion_window="24h")
    api = restart(start_http_daemon, first, args, is_cut=False).openai()
    wait_until(lambda: api.batches.retrieve(batch.id).status in ("completed", "failed", "expired", "cancelled"),
               JOB_TIMEOUT_S, poll_s=0.2)
    batch = api.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == NUM_LINES
    rows = [json.loads(line) for line in api.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(answered_in_full(row) for row in rows) == sorted(f"c{i}" for i in range(NUM_LINES))
