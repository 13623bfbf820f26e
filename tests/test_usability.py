"""What a user reaches for first: --version, prompts on stdin, plain-string batches (tiny model)."""

import asyncio
import json
import subprocess

import pytest

import cbatch
from cbatch.async_client import AsyncClient
from daemonkit import SCRIPTS_DIR, Daemon

GREEDY = {"temperature": 0, "ignore_eos": True}
DAEMON_ARGS = ("--parallel", "4", "--ctx-size", "1024", "--batch-size", "64")
COMMANDS = ("cbatch-worker", "cbatch-submit", "cbatch-status")


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    d = Daemon(tiny_model_path, *DAEMON_ARGS)
    yield d
    assert d.stop() == 0, d.log()
    d.remove_workdir()


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
    assert "3 lines, 2 ok, 1 failed" in run.stderr


def test_submit_from_stdin_that_is_not_utf8_is_a_usage_error(daemon):
    run = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), "-"], input=b'{"prompt": "\xff"}\n',
                         env=daemon.env, capture_output=True, timeout=120)
    assert run.returncode == 2 and run.stderr.decode().count("\n") == 1 and b"not UTF-8" in run.stderr


def test_batches_take_plain_strings_and_name_unlabelled_items_by_position(daemon):
    items = ["a plain prompt", {"prompt": "a dict", "max_tokens": 4, **GREEDY}, {"id": "named", "prompt": "x", **GREEDY}]
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
