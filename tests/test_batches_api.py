"""OpenAI's Files and Batches APIs on a real daemon (--http), through the `openai` package:
batches answer as the live endpoints do, in input order; bad lines land in the error file;
a cancel keeps the finished lines; kill -9 of the daemon, or of its decode worker, mid-job
loses no line and answers none twice."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from common import without_cached
from conftest import REPO
from daemonkit import SCRIPTS_DIR, serve_module, wait_until
from httpkit import HttpDaemon

JOB_TIMEOUT_S = 180.0
FINAL = ("completed", "failed", "expired", "cancelled")
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def daemon(tiny_tools_model_path):
    yield from serve_module(HttpDaemon(tiny_tools_model_path, "--parallel", "4", "--alias", "m"))




def _line(custom_id, body, url="/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _upload(api, lines: list[str]) -> str:
    return api.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch").id


def _run(api, lines: list[str], endpoint: str = "/v1/completions", timeout_s: float = JOB_TIMEOUT_S):
    """The batch of `lines`, once it ended."""
    batch = api.batches.create(input_file_id=_upload(api, lines), endpoint=endpoint, completion_window="24h")
    assert batch.status == "validating" and batch.endpoint == endpoint
    return _wait_final(api, batch.id, timeout_s)


def _wait_final(api, batch_id: str, timeout_s: float = JOB_TIMEOUT_S):
    wait_until(lambda: api.batches.retrieve(batch_id).status in FINAL, timeout_s, poll_s=0.1)
    return api.batches.retrieve(batch_id)


def _lines(api, file_id) -> list[dict]:
    return [] if file_id is None else [json.loads(line) for line in api.files.content(file_id).text.splitlines()]


def _answer(kind: str, body: dict):
    """What a greedy answer's body says, beside its ids and times."""
    if kind == "completions":
        return [(c["text"], c["finish_reason"]) for c in body["choices"]], without_cached(body["usage"])
    if kind == "chat":
        return [(c["message"]["content"], c["finish_reason"]) for c in body["choices"]], without_cached(body["usage"])
    return [d["embedding"] for d in body["data"]], body["usage"]


def test_batches_answer_as_the_live_endpoints_in_input_order(daemon, api):
    prompts = ["Once upon a time", "The capital of", "1, 2, 3,", "Hello", "A long road", "Why"]
    live_completions = [api.completions.create(model="m", prompt=p,
                                               **GREEDY).model_dump(exclude_none=True) for p in prompts]
    messages = [[{"role": "user", "content": p}] for p in prompts]
    live_chats = [api.chat.completions.create(model="m", messages=m,
                                              **GREEDY).model_dump(exclude_none=True) for m in messages]
    live_embeddings = [api.embeddings.create(model="m", input=[p,
                                                               p[::-1]]).model_dump(exclude_none=True) for p in prompts]
    cases = [("completions", "/v1/completions", [{"model": "m", "prompt": p, **GREEDY} for p in prompts],
              live_completions),
             ("chat", "/v1/chat/completions", [{"model": "m", "messages": m, **GREEDY} for m in messages], live_chats),
             ("embeddings", "/v1/embeddings", [{"model": "m", "input": [p, p[::-1]]} for p in prompts],
              live_embeddings)]
    for kind, url, bodies, live in cases:
        ids = [f"{kind}-{i}" for i in range(len(bodies))]
        batch = _run(api, [_line(i, body, url) for i, body in zip(ids, bodies)], url)
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {"total": len(ids), "completed": len(ids), "failed": 0}
        assert batch.error_file_id is None and batch.completed_at >= batch.in_progress_at >= batch.created_at
        out = _lines(api, batch.output_file_id)
        assert [o["custom_id"] for o in out] == ids
        assert all(o["error"] is None and o["response"]["status_code"] == 200 for o in out)
        assert [_answer(kind, o["response"]["body"]) for o in out] == [_answer(kind, body) for body in live]
        assert api.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_bad_lines_land_in_the_error_file(api):
    lines = [_line("ok", {"model": "m", "prompt": "hi", **GREEDY}),
             "{not json",
             json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}}),
             _line("ok", {"model": "m", "prompt": "the same id again"}),
             _line("other-url", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                   "/v1/chat/completions"),
             _line("bad-value", {"model": "m", "prompt": "x", "temperature": -1}),
             _line("unserved", {"model": "gpt-4", "prompt": "x"}),
             _line("ok-2", {"model": "m", "prompt": "there", **GREEDY})]
    batch = _run(api, lines)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 8, "completed": 2, "failed": 6}
    assert [o["custom_id"] for o in _lines(api, batch.output_file_id)] == ["ok", "ok-2"]
    errors = _lines(api, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == [None, None, None, None, "bad-value", "unserved"]
    assert [e["error"]["line"] for e in errors[:4]] == [2, 3, 4, 5]
    assert "repeats the id" in errors[2]["error"]["message"] and "endpoint" in errors[3]["error"]["message"]
    assert all(e["response"] is None for e in errors[:4])
    assert errors[4]["response"]["status_code"] == 400
    assert errors[4]["response"]["body"]["error"]["param"] == "temperature"
    assert errors[5]["response"]["status_code"] == 404 and errors[5]["error"] is None
    assert batch.id in [listed.id for listed in api.batches.list()]
    with pytest.raises(openai.BadRequestError):  # it has ended
        api.batches.cancel(batch.id)


def test_files_are_listed_retrieved_deleted_and_limited(api):
    file_id = _upload(api, [_line("a", {"prompt": "x"})])
    info = api.files.retrieve(file_id)
    assert info.purpose == "batch" and info.bytes == len(_line("a", {"prompt": "x"})) + 1
    assert file_id in [f.id for f in api.files.list(purpose="batch")]
    assert api.files.content(file_id).text == _line("a", {"prompt": "x"}) + "\n"
    assert api.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(file_id)
    with pytest.raises(openai.BadRequestError) as caught:  # one request more than OpenAI takes in a batch
        _upload(api, [_line(f"r{i}", {"prompt": "x"}) for i in range(50_001)])
    assert caught.value.body["code"] == "invalid_request" and "50000 requests" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        api.batches.create(input_file_id=_upload(api, [_line("a", {"prompt": "x"})]), endpoint="/v1/completions",
                           completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        api.batches.retrieve("batch_0")


def _long_lines(num_lines: int) -> tuple[list[str], list[str]]:
    ids = [f"req-{i}" for i in range(num_lines)]
    body = {"model": "m", "prompt": "go", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    return ids, [_line(i, body) for i in ids]


def _started(daemon, lines: list[str], num_done: int):
    """A batch of `lines`, once `num_done` of them are answered: by its results log, not its
    request counts, written only every half second (in which a fast machine runs many lines)."""
    api = daemon.openai()
    batch = api.batches.create(input_file_id=_upload(api, lines), endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: _num_answered(daemon, batch.id) >= num_done, JOB_TIMEOUT_S, poll_s=0.005)
    return batch


def _num_answered(daemon, batch_id: str) -> int:
    """The lines the job's results log holds (in its state directory; none before it exists)."""
    path = daemon.state_dir() / "batches" / f"{batch_id}.results.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_cancel_keeps_the_finished_lines(start_http_daemon, tiny_tools_model_path):
    daemon = start_http_daemon(tiny_tools_model_path, "--parallel", "1", "--alias", "m")
    api = daemon.openai()
    ids, lines = _long_lines(60)
    batch = _started(daemon, lines, 2)
    assert api.batches.cancel(batch.id).status == "cancelling"
    assert _num_answered(daemon, batch.id) < len(ids)
    batch = _wait_final(api, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at >= batch.cancelling_at, daemon.log()
    out = _lines(api, batch.output_file_id)
    assert 2 <= len(out) == batch.request_counts.completed < len(ids)
    assert len({o["custom_id"] for o in out}) == len(out) and batch.error_file_id is None
    assert [o["custom_id"] for o in out] == [i for i in ids if i in {o["custom_id"] for o in out}]  # input order
    daemon.wait_idle(30)  # its outstanding requests were cancelled


def test_kill_9_of_the_daemon_mid_job_loses_no_line_and_answers_none_twice(start_http_daemon, tiny_tools_model_path):
    args = (tiny_tools_model_path, "--parallel", "1", "--alias", "m")
    daemon = start_http_daemon(*args)
    ids, lines = _long_lines(60)
    batch = _started(daemon, lines, 3)
    daemon.process.send_signal(signal.SIGKILL)
    daemon.process.wait()
    assert _num_answered(daemon, batch.id) < len(ids)  # killed mid-job
    log_path = daemon.state_dir() / "batches" / f"{batch.id}.results.jsonl"
    before = log_path.read_bytes()
    again = start_http_daemon(*args, workdir=daemon.workdir)  # the same state directory
    batch = _wait_final(again.openai(), batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(ids)
    out = _lines(again.openai(), batch.output_file_id)
    assert [o["custom_id"] for o in out] == ids
    after = log_path.read_bytes()
    assert after.startswith(before[:before.rfind(b"\n") + 1])  # what was answered before the kill stayed
    assert sorted(json.loads(line)["custom_id"] for line in after.splitlines()) == sorted(ids)  # none twice


def test_a_killed_decode_worker_or_a_deleted_input_leaves_no_error_line(start_http_daemon, tiny_tools_model_path):
    daemon = start_http_daemon(tiny_tools_model_path, "--parallel", "1", "--alias", "m")
    api = daemon.openai()
    ids, lines = _long_lines(12)
    worker_pid = daemon.health["worker_pid"]
    batch = _started(daemon, lines, 2)
    os.kill(worker_pid, signal.SIGKILL)  # the lines it was running end worker_restarted: held and sent again
    assert _num_answered(daemon, batch.id) < len(ids)
    assert api.files.delete(batch.input_file_id).deleted  # the job keeps its own link to the bytes
    batch = _wait_final(api, batch.id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert [o["custom_id"] for o in _lines(api, batch.output_file_id)] == ids
    with daemon.client() as client:  # the lines after the kill ran on a new decode worker
        wait_until(lambda: client.health()["worker_pid"] not in (0, worker_pid), 120)


DOCS_EXAMPLE = re.compile(r"<!-- readme-test: skip: run by tests/test_batches_api.py[^>]*-->\n```(\w*)\n(.*?)```", re.S)


def test_the_docs_example_runs_as_printed(daemon):
    """docs/batch-files.md's example, with this test's port for 8000."""
    (_, command), (_, code) = DOCS_EXAMPLE.findall((REPO / "docs" / "batch-files.md").read_text())
    assert "--http 8000" in command
    out = subprocess.run([sys.executable, "-c", code.replace("8000", str(daemon.port))], capture_output=True,
                         text=True, timeout=600, check=True).stdout.splitlines()
    assert out[0] == "completed 2 0"
    assert [line.split(" ")[0] for line in out[1:]] == ["q0", "q1"]


def test_cbatch_submit_detaches_a_file_and_waits_for_its_job(daemon, api, tmp_path):
    lines = [_line(f"r{i}", {"model": "m", "prompt": p, **GREEDY}) for i, p in enumerate(["a", "b", "c"])]
    (tmp_path / "in.jsonl").write_text("\n".join([*lines, _line("bad", {"model": "m", "prompt": "x", "n": 0})]) + "\n")
    url = ["--url", f"{daemon.base_url}/v1"]
    submit = [str(SCRIPTS_DIR / "cbatch-submit"), *url]
    detached = subprocess.run([*submit, "--detach", str(tmp_path / "in.jsonl")], capture_output=True, text=True,
                              timeout=60)
    assert detached.returncode == 0, detached.stderr
    batch_id = detached.stdout.strip()
    assert api.batches.retrieve(batch_id).endpoint == "/v1/completions"
    waited = subprocess.run([*submit, "--wait", batch_id, "-o", str(tmp_path / "out.jsonl")], capture_output=True,
                            text=True, timeout=JOB_TIMEOUT_S)
    assert waited.returncode == 1, waited.stderr  # a line failed
    assert f"batch {batch_id} completed: 3 ok, 1 failed of 4" in waited.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["r0", "r1", "r2", "bad"]  # the output file's lines, then the errors'
    assert out[3]["response"]["status_code"] == 400


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/files/file-{long}"), ("GET", "/v1/files/file-{long}/content"), ("DELETE", "/v1/files/file-{long}"),
    ("GET", "/v1/batches/batch_{long}"), ("POST", "/v1/batches/batch_{long}/cancel"),
])
def test_an_id_too_long_for_a_file_name_is_unknown(daemon, method, path):
    answer = httpx.request(method, daemon.base_url + path.format(long="a" * 10_000), timeout=60)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", answer.text


def test_a_jobs_line_runs_at_batch_priority_whatever_its_body_asks(daemon, api):
    body = {"prompt": "I ask to go first", "priority": "interactive", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0}
    batch = api.batches.create(input_file_id=_upload(api, [_line("pushy", body)]), endpoint="/v1/completions",
                               completion_window="24h")
    seen = []

    def slots() -> list[dict]:
        with daemon.client() as client:
            seen[:] = client.stats()["slots"]
        return seen

    wait_until(slots, JOB_TIMEOUT_S, poll_s=0.02)
    assert [slot["priority"] for slot in seen] == ["batch"]
    api.batches.cancel(batch.id)
    assert _wait_final(api, batch.id).status == "cancelled"


def test_a_waiting_job_ends_when_its_window_does_or_it_is_cancelled_while_another_runs(daemon, api):
    """A tenant's jobs run one at a time: one waiting behind a long job ends `expired` when its window
    does, counting its requests and with a batch_expired line for each, and `cancelled` when
    it is cancelled, while the other runs."""
    # Many minutes of work, on a fast machine too: it runs all through the test, which cancels it at the end.
    _, long_lines = _long_lines(2000)
    running = _started(daemon, long_lines, 1)
    waiting_ids = [f"w{i}" for i in range(5)]
    waiting = api.batches.create(input_file_id=_upload(api, [_line(i, {"model": "m", "prompt": "x", **GREEDY})
                                                             for i in waiting_ids]),
                                 endpoint="/v1/completions", completion_window="24h")
    assert api.batches.retrieve(waiting.id).status == "validating"
    # As if its 24 hours had passed while it waited (the runner does not write a waiting job).
    path = daemon.state_dir() / "batches" / f"{waiting.id}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "expires_at": int(time.time()) - 1}))
    expired = _wait_final(api, waiting.id, timeout_s=60)
    assert expired.status == "expired" and api.batches.retrieve(running.id).status == "in_progress"
    assert expired.request_counts.total == 5 and expired.request_counts.failed == 5
    errors = _lines(api, expired.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == waiting_ids
    assert all(e["error"]["code"] == "batch_expired" for e in errors)
    cancelled = api.batches.create(input_file_id=_upload(api, [_line("c", {"model": "m", "prompt": "x", **GREEDY})]),
                                   endpoint="/v1/completions", completion_window="24h")
    api.batches.cancel(cancelled.id)  # waiting too: it ends without waiting for the runner
    cancelled = _wait_final(api, cancelled.id, timeout_s=60)
    assert cancelled.status == "cancelled" and cancelled.request_counts.total == 1
    assert api.batches.retrieve(running.id).status == "in_progress"
    api.batches.cancel(running.id)
    assert _wait_final(api, running.id).status == "cancelled"


def _runner_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "cbatch.jobs.job_runner"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def test_a_job_runner_that_keeps_dying_is_restarted_and_says_so_everywhere(start_http_daemon, tiny_tools_model_path):
    """A runner that cannot start (its lock file replaced by a directory) is never given up:
    while it is down /health says `batch_jobs: restarting` (200: chat is served),
    cbatch-status says why jobs wait, /metrics has it at 0; once the cause is gone it runs
    again and the next job completes."""
    import httpx

    daemon = start_http_daemon(tiny_tools_model_path, "--parallel", "2", "--alias", "m")
    def health() -> dict:
        return httpx.get(f"{daemon.base_url}/health", timeout=10).json()

    assert health() == {"status": "ok", "batch_jobs": "running"}
    lock = daemon.state_dir() / "runner.lock"
    before = set(_runner_pids())
    lock.unlink()
    lock.mkdir()  # the runner opens it as a file at its start: every start fails now
    for pid in before:
        if str(daemon.workdir) in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace"):
            os.kill(pid, signal.SIGKILL)
    # Each restart runs a moment before it dies again: polled, each place is seen saying so.
    wait_until(lambda: health() == {"status": "ok", "batch_jobs": "restarting"}, timeout_s=60)
    wait_until(lambda: daemon.metrics()[("cbatch_batch_job_runner_up", ())] == 0.0, timeout_s=60)
    def status() -> str:
        return subprocess.run([str(SCRIPTS_DIR / "cbatch-status")], env=daemon.env, capture_output=True, text=True,
                              timeout=60).stdout

    wait_until(lambda: "batch jobs wait: the job runner is down, restarting" in status(), timeout_s=60)
    wait_until(lambda: daemon.metrics()[("cbatch_batch_job_runner_quick_deaths", ())] >= 3, timeout_s=120)
    lock.rmdir()
    wait_until(lambda: health().get("batch_jobs") == "running", timeout_s=120)
    batch = _run(daemon.openai(), [_line("after", {"model": "m", "prompt": "x", **GREEDY})])
    assert batch.status == "completed" and batch.request_counts.completed == 1
    assert "restarting" in daemon.log() and "not restarted again" not in daemon.log()


def test_a_job_past_its_window_expires_keeping_its_finished_lines(start_http_daemon, tiny_tools_model_path):
    args = (tiny_tools_model_path, "--parallel", "1", "--alias", "m")
    daemon = start_http_daemon(*args)
    ids, lines = _long_lines(60)
    batch = _started(daemon, lines, 2)
    assert daemon.stop() == 0  # a drain: the job runner stops, its finished lines kept
    # As if its 24 hours had passed while the daemon was down.
    path = daemon.state_dir() / "batches" / f"{batch.id}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "expires_at": int(time.time()) - 1}))
    again = start_http_daemon(*args, workdir=daemon.workdir)
    api = again.openai()
    batch = _wait_final(api, batch.id)
    assert batch.status == "expired" and batch.expired_at, again.log()
    out, errors = _lines(api, batch.output_file_id), _lines(api, batch.error_file_id)
    assert 2 <= len(out) == batch.request_counts.completed and 0 < len(errors) == batch.request_counts.failed
    assert sorted(o["custom_id"] for o in out + errors) == sorted(ids)
    assert all(e["error"]["code"] == "batch_expired" and e["response"] is None for e in errors)
