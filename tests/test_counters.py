"""The daemon's counters count every token: a request's first token sampled at the end of
its prefill, and tokens across a worker restart (the progress line never goes negative)."""

import logging
import re

from common import GREEDY
from daemonkit import wait_until

from cbatch.workers.daemon.progress import ProgressLog

PROGRESS = re.compile(r"^(-?[\d.]+) tok/s generated, ")


def test_a_token_sampled_at_the_end_of_a_prefill_only_step_is_counted(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "2")
    with d.client() as client:
        for i in range(3):  # alone on the daemon: each one's prefill is a step of its own
            assert len(client.generate(prompt=f"one token {i}", max_tokens=1, **GREEDY).token_ids) == 1
        wait_until(lambda: client.stats()["requests_ended"] == 3, timeout_s=60.0)  # the stats lag 0.25 s
        assert client.stats()["generated_tokens"] == 3


def test_the_progress_line_counts_from_zero_after_a_worker_restart(caplog):
    """A restarted worker's counters start again at zero: the interval that spans the
    restart counts the new worker's tokens, never a negative rate."""
    progress = ProgressLog(1.0)
    with caplog.at_level(logging.INFO, logger="cbatch.daemon"):
        progress.update(0.0, 1, {"generated_tokens": 5000}, 0)  # busy from now
        progress.update(1.0, 1, {"generated_tokens": 6000}, 0)
        progress.update(2.0, 1, {"generated_tokens": 300}, 1)  # the worker was replaced meanwhile
    assert [float(PROGRESS.match(r.getMessage()).group(1)) for r in caplog.records] == [1000.0, 300.0]
