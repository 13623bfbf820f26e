"""The state directory does not grow for ever: the job runner removes what interrupted
writes left behind, and ended jobs (with the files they made) --batch-retention-days
after they ended, keeping uploads, unfinished jobs and recent ones."""

import json
import os
import time

import openai
import pytest
from daemonkit import wait_until

JOB_TIMEOUT_S = 180.0
HOUR_S = 3600


def _job(api, custom_id: str):
    line = json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "x", "max_tokens": 4, "temperature": 0}})
    file_id = api.files.create(file=("in.jsonl", (line + "\n").encode()), purpose="batch").id
    batch = api.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: api.batches.retrieve(batch.id).status == "completed", JOB_TIMEOUT_S, poll_s=0.1)
    return api.batches.retrieve(batch.id)


def _aged(path, age_s: float) -> None:
    os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_leftovers_and_jobs_past_their_retention_are_removed_the_rest_kept(start_http_daemon, tiny_tools_model_path):
    args = (tiny_tools_model_path, "--parallel", "2", "--alias", "m", "--batch-retention-days", "1")
    daemon = start_http_daemon(*args)
    api = daemon.openai()
    old, recent = _job(api, "old"), _job(api, "recent")
    assert daemon.stop() == 0
    state = daemon.state_dir()
    job_path = state / "batches" / f"{old.id}.json"
    stored = json.loads(job_path.read_text())
    job_path.write_text(json.dumps({**stored, "completed_at": stored["completed_at"] - 2 * 24 * HOUR_S}))
    stale = [state / "files" / ".tmp-cut", state / "batches" / ".tmp-cut", state / "files" / "file-orphan0.jsonl"]
    fresh = [state / "files" / ".tmp-writing", state / "files" / "file-uploading0.jsonl"]
    for path in stale + fresh:
        path.write_text("{}\n")
    for path in stale:
        _aged(path, 2 * HOUR_S)

    again = start_http_daemon(*args, workdir=daemon.workdir)
    api = again.openai()
    wait_until(lambda: not any(path.exists() for path in stale), 60, poll_s=0.1)
    with pytest.raises(openai.NotFoundError):
        api.batches.retrieve(old.id)
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(old.output_file_id)
    assert not list((state / "batches").glob(f"{old.id}*"))
    assert api.batches.retrieve(recent.id).status == "completed"
    assert api.files.content(recent.output_file_id).text.count("\n") == 1
    assert api.files.retrieve(old.input_file_id).purpose == "batch"  # uploads stay until deleted
    assert all(path.exists() for path in fresh)  # a write may still be under way
