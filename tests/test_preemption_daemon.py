"""Through a real daemon: interactive requests beside batch streams that hold every slot are
served while those streams run (a batch stream gives its slot up, then resumes), and the
batch streams still end with exactly their greedy solo output."""

import concurrent.futures
import re
import subprocess

from common import GREEDY
from daemonkit import SCRIPTS_DIR, wait_until

# Long enough that the interactive requests, a dozen steps each, are done far ahead of the
# batch streams (which, waiting for a slot, they would otherwise follow).
BATCH_TOKENS = 300
NUM_INTERACTIVE = 3
INTERACTIVE_TOKENS = 8
TIMEOUT_S = 300.0


def batch_body(i: int) -> dict:
    return {"prompt": f"Batch stream {i}: go on", "max_tokens": BATCH_TOKENS, "priority": "batch", **GREEDY}


def test_interactive_requests_are_served_while_saturating_batch_streams_run(tiny_model_path, start_daemon):
    daemon = start_daemon(tiny_model_path, "--parallel", "2")
    num_received = [0, 0]  # tokens each batch stream has got so far

    def run_batch(i: int) -> list[int]:
        token_ids = []
        with daemon.client() as client:
            for chunk in client.stream(**batch_body(i)):
                token_ids += chunk.token_ids
                num_received[i] = len(token_ids)
        return token_ids

    with concurrent.futures.ThreadPoolExecutor(2) as pool, daemon.client() as client:
        futures = [pool.submit(run_batch, i) for i in range(2)]
        wait_until(lambda: min(num_received) > 0, timeout_s=TIMEOUT_S)  # both run: every slot is taken
        received_at_end = []
        for i in range(NUM_INTERACTIVE):
            done = client.generate(prompt=f"Quick question {i}", max_tokens=INTERACTIVE_TOKENS, **GREEDY)
            assert done.finish_reason == "length" and len(done.token_ids) == INTERACTIVE_TOKENS
            received_at_end.append(list(num_received))
        batch = [future.result(timeout=TIMEOUT_S) for future in futures]
        # Every interactive request ended while both batch streams still ran (without preemption
        # the first would wait for one of them to end).
        assert max(max(counts) for counts in received_at_end) < BATCH_TOKENS, received_at_end
        wait_until(lambda: client.stats()["num_preemptions"] >= 1, timeout_s=10.0)  # the stats lag a little
        status = subprocess.run([str(SCRIPTS_DIR / "cbatch-status")], env=daemon.env, capture_output=True, text=True,
                                timeout=60)
        shown = re.search(r", (\d+) preemptions?$", status.stdout, re.M)
        assert shown and int(shown.group(1)) >= 1, status.stdout
        solo = [client.generate(**batch_body(i)).token_ids for i in range(2)]  # one at a time, nothing beside
    assert [len(ids) for ids in batch] == [BATCH_TOKENS] * 2 and batch == solo
