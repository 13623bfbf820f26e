"""A daemon out of descriptors refuses new clients and keeps serving the ones it has."""

import os
import sys
import resource
import time

from cbatch.errors import CbatchError
from daemonkit import pid_alive, wait_until
from common import GREEDY

LIMIT = 64  # about 24 are the daemon's own: libzmq aborted it at the 41st client
NUM_CLIENTS = 24  # about 10 fit under LIMIT; the old code refused none
REFUSE_TIMEOUT_S = 1.5


def test_clients_past_the_descriptor_limit_are_refused_and_the_daemon_serves_on(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "1")
    pid = d.process.pid
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (LIMIT, LIMIT))  # as `prlimit --pid`: read at each accept
    first = d.client()
    held = len(os.listdir(f"/proc/{pid}/fd"))
    accepted, refused = [], 0
    try:
        for _ in range(NUM_CLIENTS - 1):
            started = time.monotonic()
            try:
                accepted.append(d.client(connect_timeout_s=REFUSE_TIMEOUT_S))
            except CbatchError as err:
                assert err.code == "unavailable"
                assert time.monotonic() - started < REFUSE_TIMEOUT_S + 1.0
                refused += 1
            assert pid_alive(pid), d.log()
        assert accepted and refused >= NUM_CLIENTS // 4
        assert len(first.generate(prompt="x", max_tokens=3, **GREEDY).token_ids) == 3
        for client in accepted:
            assert client.health()["status"] == "ok"
    finally:
        for client in accepted:
            client.close()
    # The refused connections are closed too: the daemon holds what it held before the flood.
    wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= held, timeout_s=5.0)
    with d.client() as client:
        assert len(client.generate(prompt="y", max_tokens=3, **GREEDY).token_ids) == 3
    first.close()
    assert d.stop() == 0, d.log()
    assert "Assertion failed" not in d.log()
    assert d.leftovers() == []



def _under_hard_limit(limit: int) -> list[str]:
    """cbatch-worker's main, in a process whose open-file hard limit is `limit`."""
    return [sys.executable, "-c", f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
                                  "from cbatch.cli.worker import main; main()"]


def test_a_hard_limit_too_low_for_the_queue_is_named_at_start(tiny_model_path, start_daemon):
    low = start_daemon(tiny_model_path, "--parallel", "2", "--max-queue", "1024", launcher=_under_hard_limit(256))
    assert "open-file hard limit is 256, under the" in low.log()
    enough = start_daemon(tiny_model_path, "--parallel", "2", "--max-queue", "16", launcher=_under_hard_limit(256))
    assert "open-file hard limit" not in enough.log()
