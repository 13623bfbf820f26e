"""Batch jobs on a real daemon (--http), beyond OpenAI's own fields: a running job's
progress (the batch's `progress`, cbatch-status, /metrics), `/v1/responses` lines, and
jobs and files that belong to the API key's tenant, whose lines they run as."""

import json
import subprocess

import httpx
import openai
import pytest
from daemonkit import SCRIPTS_DIR, serve_module, wait_until
from httpkit import HttpDaemon

JOB_TIMEOUT_S = 300.0
FINAL = ("completed", "failed", "expired", "cancelled")
KEYS = "alice key-alice\nbob key-bob\n"


def _line(custom_id, body, url="/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _create(api, lines: list[str], endpoint: str = "/v1/completions"):
    file_id = api.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch").id
    return api.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")


def _wait_final(api, batch_id: str):
    wait_until(lambda: api.batches.retrieve(batch_id).status in FINAL, JOB_TIMEOUT_S, poll_s=0.1)
    return api.batches.retrieve(batch_id)


def _lines(api, file_id) -> list[dict]:
    return [json.loads(line) for line in api.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def daemon(tiny_tools_model_path):
    yield from serve_module(HttpDaemon(tiny_tools_model_path, "--parallel", "2", "--alias", "m"))


def test_a_running_job_shows_progress_in_the_batch_status_and_metrics(daemon, api):
    # Long enough to be seen midway and read twice more (progress is written every half second;
    # a fast machine runs a line in a few ms).
    num_lines, max_tokens = 400, 64
    body = {"model": "m", "prompt": "count", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    batch = _create(api, [_line(f"r{i}", body) for i in range(num_lines)])
    seen = []  # (lines done, progress) while the job ran

    def is_midway() -> bool:
        got = httpx.get(f"{daemon.base_url}/v1/batches/{batch.id}", timeout=10).json()
        done = got["request_counts"]["completed"] + got["request_counts"]["failed"]
        if got["status"] == "in_progress" and 0 < done < num_lines:
            seen.append((done, got["progress"]))
        return len(seen) >= 1 and seen[-1][0] >= 2 or got["status"] in FINAL

    wait_until(is_midway, JOB_TIMEOUT_S, poll_s=0.05)
    metrics = daemon.metrics()
    status = subprocess.run([str(SCRIPTS_DIR / "cbatch-status"), "--endpoint", daemon.endpoint], capture_output=True,
                            text=True, timeout=60)
    batch = _wait_final(api, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == num_lines, daemon.log()
    assert seen, "the job was never seen midway"
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # it only grows
    assert [p["generated_tokens"] for _, p in seen] == sorted(p["generated_tokens"] for _, p in seen)
    done, progress = seen[-1]
    assert progress["generated_tokens"] == done * max_tokens and progress["prompt_tokens"] > 0
    assert progress["lines_per_s"] > 0 and progress["tokens_per_s"] > 0 and progress["eta_s"] > 0
    assert set(batch.request_counts.model_dump()) == {"total", "completed", "failed"}  # OpenAI's shape, as it was
    final = batch.model_extra["progress"]
    assert final["generated_tokens"] == num_lines * max_tokens and final["eta_s"] == 0
    assert final["prompt_tokens"] == num_lines * progress["prompt_tokens"] // done
    # /metrics and cbatch-status, read while the job ran (a little after the progress above)
    assert status.returncode == 0, status.stderr
    job_line = [line for line in status.stdout.splitlines() if line.startswith(f"batch {batch.id} ")]
    assert job_line and f"/{num_lines} lines done" in job_line[0] and "lines/s" in job_line[0], status.stdout
    assert int(job_line[0].split(": ")[1].split("/")[0]) >= done
    labels = (("batch_id", batch.id), ("status", "in_progress"))
    assert metrics[("cbatch_batch_job_lines_total", labels)] == num_lines
    assert done <= metrics[("cbatch_batch_job_lines_done", labels)] <= num_lines
    assert metrics[("cbatch_batch_job_generated_tokens", labels)] >= done * max_tokens
    assert metrics[("cbatch_batch_jobs", (("status", "in_progress"),))] == 1
    after = daemon.metrics()  # an ended job has no series of its own, only its count
    assert ("cbatch_batch_job_lines_total", labels) not in after
    assert after[("cbatch_batch_jobs", (("status", "completed"),))] >= 1


def test_responses_lines_answer_as_the_live_endpoint(api):
    prompts = ["Once upon a time", "The capital of", "Why"]
    bodies = [{"model": "m", "input": p, "instructions": "Answer briefly.", "max_output_tokens": 12,
               "temperature": 0} for p in prompts]
    live = [api.responses.create(**body).model_dump() for body in bodies]
    batch = _create(api, [_line(f"x{i}", body, "/v1/responses") for i, body in enumerate(bodies)], "/v1/responses")
    batch = _wait_final(api, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(prompts), batch
    out = _lines(api, batch.output_file_id)
    assert [o["custom_id"] for o in out] == ["x0", "x1", "x2"]
    for got, want in zip((o["response"]["body"] for o in out), live):
        assert got["object"] == "response" and got["status"] == want["status"]
        assert got["instructions"] == "Answer briefly." and got["max_output_tokens"] == 12
        assert [i["content"][0]["text"] for i in got["output"]] == [i["content"][0]["text"] for i in want["output"]]
        assert {k: got["usage"][k] for k in ("input_tokens", "output_tokens")} == \
               {k: want["usage"][k] for k in ("input_tokens", "output_tokens")}
    assert batch.model_extra["progress"]["generated_tokens"] == sum(r["usage"]["output_tokens"] for r in live)


def test_a_key_sees_and_runs_only_its_tenants_files_and_batches(start_http_daemon, tiny_tools_model_path, tmp_path):
    (tmp_path / "keys").write_text(KEYS)
    daemon = start_http_daemon(tiny_tools_model_path, "--parallel", "2", "--alias", "m", "--api-keys-file",
                               str(tmp_path / "keys"))
    alice, bob = daemon.openai(api_key="key-alice"), daemon.openai(api_key="key-bob")
    num_lines, max_tokens = 5, 6
    body = {"model": "m", "prompt": "mine", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "tenant": "bob"}  # a line's body names no tenant but the key's
    batch = _create(alice, [_line(f"a{i}", body) for i in range(num_lines)])
    for call in (lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.files.retrieve(batch.input_file_id), lambda: bob.files.content(batch.input_file_id),
                 lambda: bob.files.delete(batch.input_file_id),
                 lambda: bob.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in bob.batches.list()]
    assert batch.input_file_id not in [f.id for f in bob.files.list()]
    bobs = _create(bob, [_line("b0", {**body, "tenant": "alice"})])
    assert bobs.id not in [b.id for b in alice.batches.list()] and "tenant" not in bobs.model_extra
    batch, bobs = _wait_final(alice, batch.id), _wait_final(bob, bobs.id)
    assert batch.status == bobs.status == "completed", daemon.log()
    assert [o["custom_id"] for o in _lines(alice, batch.output_file_id)] == [f"a{i}" for i in range(num_lines)]
    with pytest.raises(openai.NotFoundError):
        bob.files.content(batch.output_file_id)
    assert batch.output_file_id in [f.id for f in alice.files.list()]
    with daemon.client() as client:  # the daemon served each job's lines as its key's tenant
        tenants = client.stats()["tenants"]
    assert tenants["alice"]["num_requests"] == num_lines and tenants["bob"]["num_requests"] == 1
    assert tenants["alice"]["num_generated_tokens"] == num_lines * max_tokens
    embedded = _create(alice, [_line("e0", {"model": "m", "input": ["a few words to embed"]}, "/v1/embeddings")],
                       "/v1/embeddings")
    assert _wait_final(alice, embedded.id).status == "completed"
    with daemon.client() as client:  # an embeddings line is its key's tenant's too
        after = client.stats()["tenants"]
    assert after["alice"]["num_requests"] == num_lines + 1 and "default" not in after
    with pytest.raises(openai.AuthenticationError):
        daemon.openai(api_key="key-carol").batches.list()


def test_a_job_fills_every_slot_of_a_daemon_wider_than_64(start_http_daemon, tiny_tools_model_path):
    """A job keeps as many requests outstanding as the daemon decodes at once (at least 64):
    on --parallel 128 its lines run more than 64 at a time. (The peak, polled: an average
    over the job's steps counts its ramps, which a loaded machine stretches.)"""
    d = start_http_daemon(tiny_tools_model_path, "--parallel", "128", "--ctx-size", str(128 * 256),
                          "--threads", "1", "--alias", "m")
    api = d.openai()
    body = {"model": "m", "prompt": "count", "max_tokens": 96, "ignore_eos": True, "temperature": 0}
    batch_id = _create(api, [_line(f"r{i}", body) for i in range(256)]).id
    most_active = 0
    with d.client() as client:
        def is_final() -> bool:
            nonlocal most_active
            most_active = max(most_active, client.stats()["num_active"])
            return api.batches.retrieve(batch_id).status in FINAL
        wait_until(is_final, JOB_TIMEOUT_S, poll_s=0.02)
    batch = api.batches.retrieve(batch_id)
    assert batch.status == "completed" and batch.request_counts.completed == 256, d.log()
    assert most_active > 64, most_active


def test_jobs_of_different_tenants_run_side_by_side_and_a_tenants_own_jobs_in_turn(start_http_daemon,
                                                                                   tiny_tools_model_path, tmp_path):
    """A tenant's long job does not hold another tenant's job back: bob's job, created after
    alice's two, ends while alice's first still runs; alice's second waits for her first."""
    (tmp_path / "keys").write_text(KEYS)
    daemon = start_http_daemon(tiny_tools_model_path, "--parallel", "2", "--alias", "m", "--fair-share",
                               "--api-keys-file", str(tmp_path / "keys"))
    alice, bob = daemon.openai(api_key="key-alice"), daemon.openai(api_key="key-bob")
    body = {"model": "m", "prompt": "go", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
    long_job = _create(alice, [_line(f"a{i}", body) for i in range(5000)])
    wait_until(lambda: alice.batches.retrieve(long_job.id).request_counts.completed > 0, JOB_TIMEOUT_S, poll_s=0.1)
    second_job = _create(alice, [_line("a-next", body)])
    bobs = _create(bob, [_line(f"b{i}", body) for i in range(3)])
    assert _wait_final(bob, bobs.id).status == "completed", daemon.log()
    assert alice.batches.retrieve(long_job.id).status == "in_progress"
    assert alice.batches.retrieve(second_job.id).status == "validating"  # her first job runs: hers wait in turn
    alice.batches.cancel(long_job.id)
    assert _wait_final(alice, long_job.id).status == "cancelled"
    assert _wait_final(alice, second_job.id).status == "completed"


def test_a_ninth_tenants_job_runs_while_eight_long_jobs_take_turns(start_http_daemon, tiny_tools_model_path,
                                                                   tmp_path):
    """Eight tenants' long jobs fill the runner; a ninth tenant's job starts once the longest
    running one has had its slice, and ends while the eight are still in progress."""
    tenants = [f"t{i}" for i in range(9)]
    (tmp_path / "keys").write_text("".join(f"{tenant} key-{tenant}\n" for tenant in tenants))
    daemon = start_http_daemon(tiny_tools_model_path, "--parallel", "2", "--alias", "m", "--batch-job-slice", "2",
                               "--api-keys-file", str(tmp_path / "keys"))
    apis = {tenant: daemon.openai(api_key=f"key-{tenant}") for tenant in tenants}
    body = {"model": "m", "prompt": "go", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    long_jobs = {tenant: _create(apis[tenant], [_line(f"{tenant}-{i}", body) for i in range(5000)])
                 for tenant in tenants[:8]}
    wait_until(lambda: all(apis[tenant].batches.retrieve(job.id).status == "in_progress"
                           for tenant, job in long_jobs.items()), JOB_TIMEOUT_S, poll_s=0.2)
    ninth = _create(apis["t8"], [_line(f"t8-{i}", body) for i in range(3)])
    wait_until(lambda: apis["t8"].batches.retrieve(ninth.id).status in FINAL, 120, poll_s=0.2)
    assert apis["t8"].batches.retrieve(ninth.id).status == "completed"
    assert all(apis[tenant].batches.retrieve(job.id).status == "in_progress" for tenant, job in long_jobs.items())
    assert "gives its place to a waiting tenant's job" in daemon.log()
    for tenant, job in long_jobs.items():
        apis[tenant].batches.cancel(job.id)
    for tenant, job in long_jobs.items():
        assert _wait_final(apis[tenant], job.id).status == "cancelled"
