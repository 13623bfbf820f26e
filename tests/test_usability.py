"""What a user reaches for first: --version, prompts on stdin, plain-string batches (tiny model)."""

import asyncio
import json
import re
import subprocess
import time

import pytest
from common import GREEDY
from daemonkit import SCRIPTS_DIR, Daemon, serve_module, wait_until

import cbatch
from cbatch.client.async_client import AsyncClient

DAEMON_ARGS = ("--parallel", "4", "--ctx-size", "1024", "--batch-size", "64")
COMMANDS = ("cbatch-worker", "cbatch-submit", "cbatch-status")


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    yield from serve_module(Daemon(tiny_model_path, *DAEMON_ARGS))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_prints_its_version(command):
    run = subprocess.run([str(SCRIPTS_DIR / command), "--version"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"{command} {cbatch.__version__}"


def test_submit_reads_prompts_from_stdin(daemon, tmp_path):
    lines = [json.dumps({"id": "a", "prompt": "first", "max_tokens": 5, **GREEDY}), "",
             json.dumps({"prompt": "second", "max_tokens": 3, **GREEDY}), "{not json"]
    out = tmp_path / "stdin-results.jsonl"
    run = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), "-", "-o", str(out)], input="\n".join(lines) + "\n",
                         env=daemon.env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr  # the last line is not JSON
    first, second, bad = [json.loads(line) for line in out.read_text().splitlines()]
    assert (first["id"], first["usage"]["completion_tokens"]) == ("a", 5)
    assert (second["id"], second["usage"]["completion_tokens"]) == (3, 3)  # its line number
    assert bad["error"]["code"] == "invalid_request" and "line 4" in bad["error"]["message"]
    assert "3 lines written, 2 ok, 1 failed" in run.stderr


def test_submit_from_stdin_that_is_not_utf8_is_a_usage_error(daemon):
    run = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), "-"], input=b'{"prompt": "\xff"}\n',
                         env=daemon.env, capture_output=True, timeout=120)
    assert run.returncode == 2 and run.stderr.decode().count("\n") == 1 and b"not UTF-8" in run.stderr


def test_batches_take_plain_strings_and_name_unlabelled_items_by_position(daemon):
    items = ["a plain prompt", {"prompt": "a dict", "max_tokens": 4, **GREEDY},
             {"id": "named", "prompt": "x", **GREEDY}]
    with daemon.client() as client:
        single = client.generate(prompt="a plain prompt", max_tokens=6, **GREEDY)
        plain, unnamed, named = client.generate_batch(items)
        streamed = {}
        for position, chunk in client.stream_batch(["one", "two"]):
            assert chunk.id == position
            streamed.setdefault(position, []).append(chunk)
    assert plain.id == 0 and plain.text and plain.usage["prompt_tokens"] == single.usage["prompt_tokens"]
    assert unnamed.id == 1 and len(unnamed.token_ids) == 4
    assert named.id == "named"
    assert sorted(streamed) == [0, 1] and all(chunks[-1].finish_reason for chunks in streamed.values())


def test_async_batches_take_plain_strings(daemon):
    async def run():
        client = await AsyncClient.connect(daemon.endpoint)
        try:
            return await client.generate_batch(["first", "second"], max_in_flight=1)
        finally:
            await client.close()

    first, second = asyncio.run(run())
    assert (first.id, second.id) == (0, 1) and first.finish_reason and second.finish_reason


def wait_for(condition, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_status_shows_each_running_request_from_the_engine(tiny_model_path, start_daemon):
    # Sequences long enough to be seen running (16k tokens each).
    daemon = start_daemon(tiny_model_path, "--parallel", "4", "--ctx-size", "65536", "--batch-size", "64")
    status = [str(SCRIPTS_DIR / "cbatch-status")]
    with daemon.client() as client:
        long_prompt = "w " * 200  # prefills over several steps at 64 tokens per step
        streams = [client.submit(prompt=f"slot {i}", max_tokens=100_000, **GREEDY) for i in range(2)]
        streams.append(client.submit(prompt=long_prompt, max_tokens=100_000, **GREEDY))
        ids = {s.request_id for s in streams}
        slots = wait_for(lambda: [s for s in client.stats().get("slots", []) if s["request_id"] in ids and s["tokens"]],
                         what="running slots with tokens")
        table = subprocess.run(status, env=daemon.env, capture_output=True, text=True, timeout=30)
        raw = json.loads(subprocess.run(status + ["--json"], env=daemon.env, capture_output=True, text=True,
                                        timeout=30).stdout)
        for stream in streams:
            client.cancel(stream.request_id)
    assert slots and {s["state"] for s in slots} == {"decode"} and all(s["age_s"] > 0 for s in slots)
    assert table.returncode == 0, table.stderr
    assert ": ok, model" in table.stdout and "worker pid" in table.stdout
    lines = table.stdout.splitlines()
    # The table's header: after a `slow steps` line too, which a busy machine may bring.
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["slot", "request"])
    rows = {line.split()[1]: line.split() for line in lines[header + 1:]}
    assert lines[header].split() == ["slot", "request", "state", "prompt", "tokens", "age"]
    assert {str(i) for i in ids} <= set(rows)
    assert all(rows[str(i)][2] in ("prefill", "decode") for i in ids)
    assert raw["health"]["status"] == "ok" and {s["request_id"] for s in raw["stats"]["slots"]} >= ids
    assert [sorted(s) for s in raw["stats"]["slots"]][0] == sorted(
        ["request_id", "seq_id", "state", "priority", "prompt_tokens", "prompt_tokens_done", "tokens", "age_s"])


def test_status_without_a_daemon_is_one_line_and_exit_3(tmp_path):
    run = subprocess.run([str(SCRIPTS_DIR / "cbatch-status"), "--endpoint", f"ipc://{tmp_path}/nobody.sock"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 3 and run.stderr.count("\n") == 1 and "no cbatch daemon answers" in run.stderr


@pytest.mark.parametrize("quiet", [False, True], ids=["progress", "quiet"])
def test_busy_daemon_logs_progress_lines_and_an_idle_one_none(tiny_model_path, start_daemon, quiet):
    d = start_daemon(tiny_model_path, *DAEMON_ARGS, "--progress-interval", "0.5", *(["--quiet"] if quiet else []))
    progress = re.compile(r"^[\d.]+ tok/s generated, \d+ requests? finished in the last [\d.]+ s; "
                          r"\d+ active, \d+ queued, \d+ requests? in flight$", re.M)
    with d.client() as client:
        client.generate_batch([{"prompt": f"busy {i}", "max_tokens": 200, **GREEDY} for i in range(4)] * 3)
        if not quiet:  # the interval that saw the last requests finish ends with a line of its own
            wait_until(lambda: any(line.endswith(" 0 requests in flight") for line in progress.findall(d.log())),
                       timeout_s=120.0)
        busy_lines = progress.findall(d.log())
        time.sleep(1.5)  # idle for three intervals: no line may appear
        assert progress.findall(d.log()) == busy_lines
    if quiet:
        assert busy_lines == []
    else:
        assert any(not line.startswith("0.0 tok/s") for line in busy_lines), d.log()


@pytest.mark.parametrize("ctx_size, parallel, ctx_per_seq", [(100, 1, 256), (4000, 3, 1536)])
def test_each_sequence_context_rounds_up_to_256_as_the_readme_says(tiny_model_path, start_daemon, ctx_size,
                                                                    parallel, ctx_per_seq):
    d = start_daemon(tiny_model_path, "--ctx-size", str(ctx_size), "--parallel", str(parallel))
    assert d.health["ctx_per_seq"] == ctx_per_seq
    assert f"context {ctx_per_seq} per sequence" in d.log()


def test_a_batch_file_with_a_byte_order_mark_and_a_control_character(tiny_model_path, start_daemon, tmp_path):
    """Some editors start a file with a UTF-8 byte-order mark: the first line still runs. A
    line with a raw control character inside a string says where, not a cut sentence."""
    daemon = start_daemon(tiny_model_path, *DAEMON_ARGS)
    source, output = tmp_path / "bom.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(b'\xef\xbb\xbf{"id": "first", "prompt": "hi", "max_tokens": 2}\n'
                       b'{"id": "tab", "prompt": "a\tb", "max_tokens": 2}\n')
    run = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(source), "-o", str(output)], env=daemon.env,
                         capture_output=True, text=True, timeout=120)
    first, bad = (json.loads(line) for line in output.read_text().splitlines())
    assert run.returncode == 1, run.stderr  # the second line is bad
    assert first["id"] == "first" and first["usage"]["completion_tokens"] == 2
    assert bad["error"]["message"] == "line 2 is not valid JSON: Invalid control character at (column 27)"


MAX_STARVED_ROUNDS = 10


def test_status_says_when_the_compute_threads_are_starved(tiny_model_path, start_daemon):
    """Two compute threads on one core get half of it at most: the steps are slow for want
    of CPU, not of work, and cbatch-status says so and which setting helps."""
    daemon = start_daemon(tiny_model_path, *DAEMON_ARGS, "--threads", "2", prefix=("taskset", "-c", "0"))
    with daemon.client() as client:
        # The share is smoothed over the timed steps (decodes of at least a millisecond): a
        # fast machine times few of a round's steps, so rounds run until the share settles.
        for _ in range(MAX_STARVED_ROUNDS):
            client.generate_batch([{"prompt": f"starved {i}", "max_tokens": 300, **GREEDY} for i in range(4)])
            # The idle worker's last figures: an earlier report may hold the share before the
            # round's last timed steps.
            share = wait_for(lambda: (lambda s: s["compute_cpu_share"] if s["num_active"] == 0 else None)(
                client.stats()), what="the idle worker's figures")
            if share < 0.6:
                break
    table = subprocess.run([str(SCRIPTS_DIR / "cbatch-status")], env=daemon.env, capture_output=True, text=True,
                           timeout=60)
    assert share < 0.6, share
    assert "slow steps: llama.cpp's compute threads got" in table.stdout and "--threads" in table.stdout
