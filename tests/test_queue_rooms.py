"""Each priority's room in the queue, through a real daemon: a batch submitter that fills
its room never gets an interactive HTTP caller a 429 (nor writes a refused line as a
result), and requests with a week-long timeout leave nothing behind in the decode worker
once they finished."""

import concurrent.futures
import json
import subprocess

import httpx
import pytest
from daemonkit import SCRIPTS_DIR, serve_module, wait_until
from httpkit import HttpDaemon

from cbatch.errors import QUEUE_FULL, CbatchError

MODEL_ID = "tiny-llama.gguf"
INTERACTIVE_QUEUE = 3
BATCH_QUEUE = 6
ENDLESS = {"max_tokens": 100_000, "ignore_eos": True}
WEEK_S = 604800
NUM_WARMUP_REQUESTS = 1000
NUM_MEASURED_REQUESTS = 5000
SUBMIT_IN_FLIGHT = 2000  # far past the batch room: most of its requests are refused, held and sent again
# Every line in flight at once, each long enough (BATCH_LINE_TOKENS steps) that the batch room
# stays full between the submitter's resends long enough for the stats to show it, and the
# file outlasts the interactive callers' asks (counted in steps, whatever the machine's speed).
NUM_BATCH_LINES = 200
BATCH_LINE_TOKENS = 50
NUM_ASKS = 10
WAIT_S = 300.0
# Before, each finished request stayed in the deadline heap until its deadline passed: the
# worker grew 5.9 MB over these 5000 (about 1.2 kB each); now 0.2-0.5 MB. A third of before:
MAX_GROWTH_BYTES = NUM_MEASURED_REQUESTS * 1200 // 3


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    # Without preemption, so that the interactive callers wait in their room behind the
    # running batch request (with it, they would take its slot at once).
    yield from serve_module(HttpDaemon(tiny_model_path, "--parallel", "1", "--max-queue", str(INTERACTIVE_QUEUE),
                                       "--max-batch-queue", str(BATCH_QUEUE), "--no-preempt-batch"))


def test_a_full_batch_queue_never_refuses_an_interactive_caller(daemon, api):
    num_interactive = 1 + INTERACTIVE_QUEUE  # --parallel + --max-queue: all of them wait behind the batch
    with daemon.client() as submitter:
        # More than its room: --parallel + --max-batch-queue are taken, the rest refused.
        batch = [submitter.submit(f"batch {i}", priority="batch", **ENDLESS) for i in range(1 + BATCH_QUEUE + 4)]
        for stream in batch[1 + BATCH_QUEUE:]:
            with pytest.raises(CbatchError) as err:
                list(submitter.read(stream))
            assert err.value.code == QUEUE_FULL and "--max-batch-queue" in err.value.message
        with concurrent.futures.ThreadPoolExecutor(num_interactive) as pool:
            calls = [pool.submit(api.completions.create, model=MODEL_ID, prompt=f"ask {i}", max_tokens=4,
                                 temperature=0, extra_body={"ignore_eos": True}) for i in range(num_interactive)]
            # Both rooms full at once: the batch one and every interactive caller waiting.
            wait_until(lambda: submitter.stats()["num_queued"] == BATCH_QUEUE + num_interactive, timeout_s=120.0)
            for stream in batch[:1 + BATCH_QUEUE]:
                submitter.cancel(stream.request_id)  # frees the slot: the interactive callers go first
            answers = [call.result(timeout=60) for call in calls]  # a 429 would raise here
    assert [answer.choices[0].finish_reason for answer in answers] == ["length"] * num_interactive


def test_a_submitter_at_2000_in_flight_beside_interactive_callers_refuses_none_of_them(daemon, tmp_path):
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [f"b{i}" for i in range(NUM_BATCH_LINES)]
    prompts.write_text("".join(json.dumps({"id": line_id, "prompt": line_id, "max_tokens": BATCH_LINE_TOKENS,
                                           "ignore_eos": True, "temperature": 0}) + "\n"
                               for line_id in ids))
    submitter = subprocess.Popen([str(SCRIPTS_DIR / "cbatch-submit"), str(prompts), "-o", str(output),
                                  "--max-in-flight", str(SUBMIT_IN_FLIGHT)], env=daemon.env, stderr=subprocess.PIPE,
                                 text=True)

    def ask(caller: int) -> list[int]:
        """A caller's statuses: it asks again as each answer comes (interactive requests go
        first, so the file's lines run between and after them)."""
        body = {"model": MODEL_ID, "prompt": f"ask {caller}", "max_tokens": 4, "temperature": 0}
        return [httpx.post(f"{daemon.base_url}/v1/completions", json=body, timeout=WAIT_S).status_code
                for _ in range(NUM_ASKS)]

    try:
        with daemon.client() as watcher:  # the batch room full: the submitter's refused requests are held
            wait_until(lambda: watcher.stats()["num_queued"] >= BATCH_QUEUE, timeout_s=WAIT_S)
        # --parallel + --max-queue callers: as many as the interactive room holds at once.
        with concurrent.futures.ThreadPoolExecutor(1 + INTERACTIVE_QUEUE) as pool:
            statuses = sum(pool.map(ask, range(1 + INTERACTIVE_QUEUE)), [])
        is_still_submitting = submitter.poll() is None
        _, stderr = submitter.communicate(timeout=WAIT_S)
    finally:
        submitter.kill()
        submitter.wait()
    assert set(statuses) == {200}, sorted(set(statuses))  # a 429 would be a refusal
    assert is_still_submitting  # the callers asked while the file ran
    assert submitter.returncode == 0, stderr
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [result["id"] for result in results] == ids
    assert [result["error"] for result in results if "error" in result] == []


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _run_finished_requests(client, num_requests: int) -> None:
    items = [{"prompt": "x", "max_tokens": 1, "temperature": 0, "priority": "batch", "timeout": WEEK_S}
             for _ in range(num_requests)]
    results = client.generate_batch(items, max_in_flight=1 + INTERACTIVE_QUEUE)
    assert not [result for result in results if isinstance(result, CbatchError)]


def test_finished_requests_with_a_week_long_timeout_leave_the_decode_worker_no_larger(daemon):
    with daemon.client() as client:
        worker_pid = client.health()["worker_pid"]
        _run_finished_requests(client, NUM_WARMUP_REQUESTS)  # the allocator's pools, the prefix cache
        before = _rss_bytes(worker_pid)
        _run_finished_requests(client, NUM_MEASURED_REQUESTS)
        growth = _rss_bytes(worker_pid) - before
        assert client.health()["worker_pid"] == worker_pid
    assert growth < MAX_GROWTH_BYTES, f"the decode worker grew {growth} bytes over {NUM_MEASURED_REQUESTS} requests"
