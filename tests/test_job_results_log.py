"""A batch job's results log when the disk fails it, through a real daemon (--http, the
tiny model): a line damaged on disk is dropped and run again, and a disk that fills up
pauses the job, leaving no part of a line behind, until there is room again."""

import json
import os
import subprocess
import tempfile

import pytest
from daemonkit import wait_until
from test_batches_api import _line, _lines, _long_lines, _num_answered, _upload, _wait_final

from cbatch.jobs.results import parsed_result

SMALL_DISK = "128k"  # the state directory's tmpfs: room for the job's input, not for its results


def test_a_damaged_line_in_the_middle_of_the_log_is_run_again(start_http_daemon, tiny_tools_model_path):
    args = (tiny_tools_model_path, "--parallel", "1", "--alias", "m")
    daemon = start_http_daemon(*args)
    ids, lines = _long_lines(60)
    api = daemon.openai()
    batch = api.batches.create(input_file_id=_upload(api, lines), endpoint="/v1/completions", completion_window="24h")
    # The log itself says when lines are done (request counts are written only every half
    # second, in which a fast machine runs many lines).
    wait_until(lambda: _num_answered(daemon, batch.id) >= 3, 180, poll_s=0.005)
    assert daemon.stop() == 0  # a drain: the finished lines stay in the log
    log_path = daemon.state_dir() / "batches" / f"{batch.id}.results.jsonl"
    logged = log_path.read_bytes().splitlines(keepends=True)
    assert len(logged) < len(ids), "the job ended before the stop: it needs more lines"
    damaged_id = json.loads(logged[1])["custom_id"]
    # A middle line damaged on disk, and a last one cut short.
    log_path.write_bytes(b"".join([logged[0], b'{"custom_id": "req-\x00\xff garbage\n', *logged[2:], b'{"cust']))
    again = start_http_daemon(*args, workdir=daemon.workdir)
    api = again.openai()
    batch = _wait_final(api, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(ids), again.log()
    out = _lines(api, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(ids) and damaged_id in ids
    assert all(parsed_result(line) is not None for line in log_path.read_bytes().splitlines(keepends=True))


@pytest.fixture
def small_disk():
    """A directory on a tmpfs of SMALL_DISK (mounting needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path = tempfile.mkdtemp(prefix="cbt-disk-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK}", "tmpfs", path], check=True)
    yield path
    # Lazily: a daemon a failed test left running lets go of it when the fixture stops it.
    subprocess.run(["umount", "--lazy", path], check=True)
    os.rmdir(path)


def test_a_full_disk_pauses_the_job_which_goes_on_once_there_is_room(start_http_daemon, tiny_tools_model_path,
                                                                      small_disk):
    """The results log never keeps part of a line, the job waits (the log says why) rather
    than failing or losing lines, and once the disk has room it completes, each line once."""
    daemon = start_http_daemon(tiny_tools_model_path, "--parallel", "2", "--alias", "m", "--state-dir", small_disk)
    api = daemon.openai()
    body = {"model": "m", "prompt": "fill", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    ids = [f"f{i}" for i in range(80)]
    batch = api.batches.create(input_file_id=_upload(api, [_line(i, body) for i in ids]),
                               endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: "the state directory's disk is full" in daemon.log(), timeout_s=300)
    assert api.batches.retrieve(batch.id).status in ("in_progress", "finalizing")
    log_path = os.path.join(small_disk, "batches", f"{batch.id}.results.jsonl")
    with open(log_path, "rb") as log:
        assert all(parsed_result(line) is not None for line in log)
    assert api.completions.create(model="m", prompt="still here", max_tokens=2).usage.completion_tokens == 2
    subprocess.run(["mount", "-o", "remount,size=8m", small_disk], check=True)
    batch = _wait_final(api, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(ids), batch
    assert sorted(o["custom_id"] for o in _lines(api, batch.output_file_id)) == sorted(ids)
    assert daemon.stop() == 0


def test_only_a_newline_ends_a_line_as_the_upload_counted_them(start_http_daemon, tiny_tools_model_path):
    """Lines joined by a bare "\r" are one line (one error, costing only itself), as the
    upload's request count saw them; "\r\n" line ends read as lines."""
    daemon = start_http_daemon(tiny_tools_model_path, "--parallel", "2", "--alias", "m")
    api = daemon.openai()
    body = {"model": "m", "prompt": "x", "max_tokens": 2, "temperature": 0}
    cases = {"cr": ("\r".join(_line(f"cr{i}", body) for i in range(3)) + "\n", 1, 0),
             "crlf": ("\r\n".join(_line(f"crlf{i}", body) for i in range(2)) + "\r\n", 2, 2)}
    for name, (text, num_lines, num_ok) in cases.items():
        file_id = api.files.create(file=(f"{name}.jsonl", text.encode()), purpose="batch").id
        batch = _wait_final(api, api.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                                    completion_window="24h").id)
        assert batch.status == "completed", (name, batch)
        assert (batch.request_counts.total, batch.request_counts.completed) == (num_lines, num_ok), (name, batch)
