"""A batch job's run, without a daemon: a job cancelled before it started ends the same
way whoever ends it, the runner's waiting pass or its own start."""

import io
import json

import pytest

from cbatch.jobs.batches import BatchStore
from cbatch.jobs.job_run import JobRun


@pytest.mark.parametrize("ended_by", ["its start", "the waiting pass"])
def test_a_job_cancelled_before_it_started_counts_its_requests(tmp_path, ended_by):
    store = BatchStore(str(tmp_path))
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "m", "prompt": "x"}}) + "\n" for i in range(3))
    file = store.files.upload(io.BytesIO(lines.encode()), "in.jsonl", "batch")
    batch = store.create({"input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    store.cancel(batch["id"])
    run = JobRun(store, batch["id"])
    assert run.run() if ended_by == "its start" else run.end_waiting()
    ended = store.get(batch["id"])
    assert ended["status"] == "cancelled" and ended["request_counts"]["total"] == 3
