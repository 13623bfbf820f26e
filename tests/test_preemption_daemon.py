"""Through a real daemon: interactive requests beside batch streams that hold every slot are
served while those streams run (a batch stream gives its slot up, then resumes), and the
batch streams still end with their greedy solo output: token for token, up to a near-tie
that llama.cpp's kernels may flip (docs/operations.md: a resumed sequence's KV is
recomputed in a prefill chunk, and a batch of another shape rounds differently)."""

import concurrent.futures
import re
import subprocess

from common import GREEDY
from conftest import load_script
from daemonkit import SCRIPTS_DIR, wait_until

# Long enough that the interactive requests, a dozen steps each, are done far ahead of the
# batch streams (which, waiting for a slot, they would otherwise follow).
BATCH_TOKENS = 300
NUM_INTERACTIVE = 3
INTERACTIVE_TOKENS = 8
TIMEOUT_S = 300.0
# A flipped near-tie: the two tokens' log-probabilities in the solo run differ by less than
# this. Rounding moves logits by ~1e-4; a lost or repeated token lands anywhere.
NEAR_TIE_LOGPROB = 0.01
NUM_TOP_LOGPROBS = 5


def token_bytes(token_id: int) -> bytes:
    """A token's bytes in the byte-level vocabulary of the random-weight test model."""
    tiny_model = load_script("make_tiny_model").llama
    if token_id == tiny_model.SPACE_ID:
        return b" "
    return bytes([token_id - tiny_model.FIRST_BYTE_ID])


def assert_greedy_up_to_a_near_tie(token_ids: list[int], solo) -> None:
    """token_ids is solo's output, or follows it up to a position where solo's greedy choice
    and token_ids' were a near-tie (what comes after it is then another greedy run)."""
    assert len(token_ids) == len(solo.token_ids) == BATCH_TOKENS
    diverged_at = next((i for i, (a, b) in enumerate(zip(token_ids, solo.token_ids)) if a != b), None)
    if diverged_at is None:
        return
    top = solo.logprobs[diverged_at]["top_logprobs"]
    logprob_of = {bytes(entry["bytes"]): entry["logprob"] for entry in top}
    taken = token_bytes(token_ids[diverged_at])
    assert taken in logprob_of and top[0]["logprob"] - logprob_of[taken] < NEAR_TIE_LOGPROB, \
        (diverged_at, token_ids[diverged_at], top)


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
        wait_until(lambda: client.stats()["num_preemptions"] >= 1, timeout_s=60.0)  # the stats lag a little
        status = subprocess.run([str(SCRIPTS_DIR / "cbatch-status")], env=daemon.env, capture_output=True, text=True,
                                timeout=60)
        shown = re.search(r", (\d+) preemptions?$", status.stdout, re.M)
        assert shown and int(shown.group(1)) >= 1, status.stdout
        solo = [client.generate(**batch_body(i), logprobs=NUM_TOP_LOGPROBS) for i in range(2)]  # one at a time
    for token_ids, solo_completion in zip(batch, solo):
        assert_greedy_up_to_a_near_tie(token_ids, solo_completion)
