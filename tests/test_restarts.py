"""Requests across restarts: of the decode worker (held requests go to the next one, even
while the daemon drains) and of the whole daemon (its clients learn what it lost)."""

import os
import signal
import time
from pathlib import Path

import pytest
from common import GREEDY
from daemonkit import child_pids, pid_alive, wait_until

from cbatch.errors import CbatchError

DAEMON_ARGS = ("--parallel", "2", "--ctx-size", str(2 * 16384))
RESTART_TIMEOUT_S = 60.0


def submit_while_restarting(client, **body):
    """Kill the decode worker and submit while its successor loads: the front-end holds the
    request. The health asked after the submit, answered in order, proves it was held."""
    old_pid = client.health()["worker_pid"]
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: client.health()["status"] != "ok", timeout_s=60.0)
    stream = client.submit(**body)
    health = client.health()
    assert health["status"] == "starting" and health["worker_pid"] == 0, health
    return old_pid, stream


def test_a_submit_held_across_a_worker_restart_completes_on_the_new_worker(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *DAEMON_ARGS)
    with d.client() as client:
        old_pid, stream = submit_while_restarting(client, prompt="held", max_tokens=50, **GREEDY)
        chunks = list(client.read(stream))
        new_pid = client.health()["worker_pid"]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 50
    assert len(sum((c.token_ids for c in chunks), [])) == 50
    assert new_pid not in (0, old_pid) and pid_alive(new_pid) and not pid_alive(old_pid)
    assert d.stop() == 0


def test_a_drain_while_the_worker_restarts_finishes_held_requests_and_exits_clean(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *DAEMON_ARGS)
    ring_name = d.ring_name()
    with d.client() as client, d.client() as latecomer:
        old_pid, stream = submit_while_restarting(client, prompt="held", max_tokens=50, **GREEDY)
        children = child_pids(d.process.pid)  # the new worker among them, still loading
        d.process.send_signal(signal.SIGTERM)
        wait_until(lambda: latecomer.health()["status"] == "draining", timeout_s=60.0)
        with pytest.raises(CbatchError) as err:
            latecomer.generate(prompt="late", max_tokens=3)
        assert err.value.code == "shutting_down"
        # The drain waits for the new worker, which runs the held request (the grace is 30 s).
        chunks = list(client.read(stream))
    assert chunks[-1].finish_reason == "length" and len(sum((c.token_ids for c in chunks), [])) == 50
    assert d.stop() == 0, d.log()
    assert children and old_pid not in children
    wait_until(lambda: not any(pid_alive(pid) for pid in [old_pid, *children]), timeout_s=60.0)
    assert not os.path.exists(f"/dev/shm/{ring_name}")
    assert d.leftovers() == []


def test_a_client_of_a_restarted_daemon_learns_its_request_was_lost(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *DAEMON_ARGS)
    worker_pid = d.health["worker_pid"]
    with d.client() as client:
        stream = client.stream(prompt="lost", max_tokens=16000, **GREEDY)
        next(stream)
        d.process.kill()  # no drain: nothing tells the client its request is gone
        d.process.wait()
        wait_until(lambda: not pid_alive(worker_pid), timeout_s=60.0)
        again = start_daemon(tiny_model_path, *DAEMON_ARGS, workdir=d.workdir, endpoint=d.endpoint)
        # The client's socket reconnects to the new daemon by itself; its liveness ping
        # (after 2 s of silence) names the request, which the new daemon does not know.
        waiting_since = time.monotonic()
        with pytest.raises(CbatchError) as err:
            list(stream)
        waited_s = time.monotonic() - waiting_since
        assert err.value.code == "unavailable" and "no longer knows this request" in err.value.message
        assert waited_s < 5.0  # one ping, not the two unanswered ones that mean a dead daemon
        # The same client goes on with the new daemon (its records come by FETCH: the ring
        # it attached to is the old daemon's).
        again_result = client.generate(prompt="again", max_tokens=5, **GREEDY)
    assert again_result.finish_reason == "length" and len(again_result.token_ids) == 5
    assert again.stop() == 0


def test_a_request_cancelled_while_held_reaches_a_ring_reader_without_a_fetch(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *DAEMON_ARGS)
    with d.client() as client:
        assert client.info["use_ring"]
        num_fetches = client.stats()["num_fetches"]
        _, stream = submit_while_restarting(client, prompt="held", max_tokens=50, **GREEDY)
        client.cancel(stream.request_id)
        # Answered in order after the cancel: the cancel found the request still held.
        assert client.health()["status"] == "starting"
        chunks = list(client.read(stream))
        # The front-end made this finish itself and no worker wrote it to the ring: it sends
        # the records too, so the reader has them without a FETCH (the front-end's own count).
        assert client.stats()["num_fetches"] == num_fetches
    assert chunks[-1].finish_reason == "cancelled" and chunks[-1].usage["completion_tokens"] == 0
    assert sum((c.token_ids for c in chunks), []) == []
    assert d.stop() == 0


def test_a_client_of_a_restarted_daemon_reads_the_new_daemons_ring(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *DAEMON_ARGS)
    with d.client() as client:
        old_ring = client.info["ring_name"]
        assert client.generate(prompt="before", max_tokens=3, **GREEDY).finish_reason == "length"
        d.process.kill()
        d.process.wait()
        again = start_daemon(tiny_model_path, *DAEMON_ARGS, workdir=d.workdir, endpoint=d.endpoint)
        # Its socket reconnected by itself; the new daemon relays it until it says HELLO
        # again, and tells it so: then it reads the new daemon's ring, with no FETCH.
        first = client.generate(prompt="after", max_tokens=20, **GREEDY)
        second = client.generate(prompt="after again", max_tokens=20, **GREEDY)
        assert client.info["ring_name"] == again.ring_name() != old_ring
        assert client.info["use_ring"] and client.stats()["num_fetches"] == 0
    assert [len(first.token_ids), len(second.token_ids)] == [20, 20]
    assert again.stop() == 0


def _next_worker(daemon_pid: int, known: set[int]) -> int:
    """The pid of a decode worker the supervisor started after `known`, as soon as it exists."""
    def new_workers():
        return [pid for pid in child_pids(daemon_pid) if pid not in known
                and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    wait_until(lambda: new_workers(), timeout_s=60.0, poll_s=0.01)
    return new_workers()[0]


def test_clients_are_answered_while_the_supervisor_backs_off_between_worker_starts(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *DAEMON_ARGS)
    known = {d.health["worker_pid"]}
    with d.client() as client:
        os.kill(d.health["worker_pid"], signal.SIGKILL)
        latencies = []
        for _ in range(2):  # two starts that die before READY: back-offs of 1 s, then 2 s
            pid = _next_worker(d.process.pid, known)
            known.add(pid)
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.3)  # the supervisor has seen it die, and backs off
            asked = time.monotonic()
            assert client.health()["status"] == "starting"
            latencies.append(time.monotonic() - asked)
        assert max(latencies) < 0.8, latencies
        result = client.generate(prompt="after the back-off", max_tokens=3, **GREEDY)
    assert result.finish_reason == "length"
    assert d.stop() == 0, d.log()


def test_a_ring_removed_from_dev_shm_is_created_again_when_the_worker_restarts(tiny_model_path, start_daemon):
    """A cleaner of /dev/shm (or a remounted tmpfs) removes the ring: the restarted worker
    could not attach it and the daemon gave up. Now a new ring is created and every client
    moves to it, reading its tokens from there (no FETCH), and shutdown leaves no segment."""
    d = start_daemon(tiny_model_path, *DAEMON_ARGS)
    with d.client() as client:
        old_ring = client.info["ring_name"]
        os.unlink(f"/dev/shm/{old_ring}")
        _, held = submit_while_restarting(client, prompt="held", max_tokens=50, **GREEDY)
        held_chunks = list(client.read(held))
        new_ring = client.info["ring_name"]
        assert new_ring != old_ring and os.path.exists(f"/dev/shm/{new_ring}")
        num_fetches = client.stats()["num_fetches"]
        with d.client() as fresh:
            assert fresh.info["use_ring"] and fresh.info["ring_name"] == new_ring
            fresh._session.read_latencies_ns, client._session.read_latencies_ns = [], []  # one per ring read
            fresh_result = fresh.generate(prompt="fresh", max_tokens=20, **GREEDY)
            assert fresh._session.read_latencies_ns
        again = client.generate(prompt="again", max_tokens=20, **GREEDY)
        assert client._session.read_latencies_ns and client.stats()["num_fetches"] == num_fetches
    assert len(sum((c.token_ids for c in held_chunks), [])) == 50
    assert [len(fresh_result.token_ids), len(again.token_ids)] == [20, 20]
    assert "token ring" in d.log() and "removed" in d.log()
    assert d.stop() == 0, d.log()
    assert [name for name in os.listdir("/dev/shm") if name.startswith(f"cbatch-{d.process.pid}")] == []
    assert d.leftovers() == []
