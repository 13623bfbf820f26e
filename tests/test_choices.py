"""A request's `n` choices end together on every path: the first choice that fails
cancels its siblings at once (they do not decode to the end), through the blocking and
the asyncio client. A batch file holds a choice the daemon refuses for a moment instead."""

import asyncio
import json
import subprocess

import pytest
from common import GREEDY
from daemonkit import SCRIPTS_DIR, wait_until

from cbatch import AsyncClient
from cbatch.errors import QUEUE_FULL, CbatchError

MAX_TOKENS = 3000
# One slot and two queue places: of four choices, three are accepted and the fourth is
# refused with queue_full at once. Left running, the three would decode 3 x MAX_TOKENS.
ONE_SLOT_ARGS = ("--parallel", "1", "--max-queue", "2", "--ctx-size", "8192")


def assert_siblings_were_cancelled(daemon, before: dict) -> None:
    with daemon.client(use_ring=False) as watcher:
        wait_until(lambda: watcher.stats()["num_in_flight"] == 0, timeout_s=60.0)
        after = watcher.stats()
    assert after["generated_tokens"] - before["generated_tokens"] < MAX_TOKENS
    num_cancelled = [stats["num_requests_by_outcome"].get("cancelled", 0) for stats in (before, after)]
    assert num_cancelled[1] - num_cancelled[0] >= 1


def stats(daemon) -> dict:
    with daemon.client(use_ring=False) as watcher:
        return watcher.stats()


@pytest.fixture
def one_slot_daemon(tiny_model_path, start_daemon):
    return start_daemon(tiny_model_path, *ONE_SLOT_ARGS)


def test_generate_with_n_fails_at_the_first_refused_choice(one_slot_daemon):
    before = stats(one_slot_daemon)
    with one_slot_daemon.client() as client:
        with pytest.raises(CbatchError) as err:
            client.generate(prompt="four ways", n=4, max_tokens=MAX_TOKENS, **GREEDY)
    assert err.value.code == QUEUE_FULL
    assert_siblings_were_cancelled(one_slot_daemon, before)


def test_async_generate_with_n_fails_at_the_first_refused_choice(one_slot_daemon):
    before = stats(one_slot_daemon)

    async def run():
        async with await AsyncClient.connect(one_slot_daemon.endpoint) as client:
            await client.generate(prompt="four ways", n=4, max_tokens=MAX_TOKENS, **GREEDY)

    with pytest.raises(CbatchError) as err:
        asyncio.run(run())
    assert err.value.code == QUEUE_FULL
    assert_siblings_were_cancelled(one_slot_daemon, before)


def test_a_batch_line_with_n_holds_its_refused_choice_until_there_is_room(one_slot_daemon, tmp_path):
    """cbatch-submit: a choice refused with queue_full is no result: it is held and sent
    again while its siblings run, and the line ends with all its choices."""
    lines = [{"id": "four", "prompt": "four ways", "n": 4, "max_tokens": 5, **GREEDY},
             {"id": "after", "prompt": "next", "max_tokens": 5, **GREEDY}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    process = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(tmp_path / "in.jsonl"), "-o",
                              str(tmp_path / "out.jsonl")], env=one_slot_daemon.env, capture_output=True,
                             text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    four, after = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [choice["usage"]["completion_tokens"] for choice in four["choices"]] == [5] * 4
    assert len({choice["text"] for choice in four["choices"]}) == 1  # greedy: the same text each time
    assert after["id"] == "after" and after["usage"]["completion_tokens"] == 5
