"""Faults survived: dead clients, a killed or hung worker, signals, a killed supervisor."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from common import GREEDY
from daemonkit import SCRIPTS_DIR, RawPeer, pid_alive, wait_until

from cbatch.errors import EXIT_UNREACHABLE, CbatchError
from cbatch.protocol import MsgType
from cbatch.workers.daemon.backlog import MAX_STALL_S


def test_killed_client_has_its_requests_cancelled_and_slots_freed(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "3", "--ctx-size", str(3 * 16384))
    try:
        victim = subprocess.Popen([sys.executable, "-c", (
            "import cbatch; c = cbatch.Client(); "
            "streams = [c.stream(prompt='Tell a long story', max_tokens=16000, ignore_eos=True) for _ in range(2)]; "
            "next(streams[0]); print('streaming', flush=True); [list(s) for s in streams]")],
            env=d.env, stdout=subprocess.PIPE, text=True)
        assert victim.stdout.readline().strip() == "streaming"
        with d.client() as client:
            survivor = client.stream(prompt="survivor", max_tokens=1500, **GREEDY)
            wait_until(lambda: client.stats()["num_active"] == 3, timeout_s=60.0)  # the stats lag 0.25 s
            victim.kill()
            victim.wait()
            # Only the survivor's sequence is left (the stats are at most 0.25 s stale).
            freed_s = wait_until(lambda: client.stats()["num_active"] <= 1, timeout_s=60.0)
            chunks = list(survivor)
        assert freed_s < 10.0  # left running, its 16000-token requests would hold their slots far longer
        # The survivor ran to the end, every token delivered (exact outputs are not compared:
        # llama.cpp's kernels are not batch invariant, so a changed batch may flip a near-tie).
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 1500
        assert len(sum((c.token_ids for c in chunks), [])) == 1500
    finally:
        assert d.stop() == 0


def test_killed_worker_fails_in_flight_requests_and_is_restarted(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 8192))
    try:
        old_pid = d.health["worker_pid"]
        with d.client() as client:
            cached = {"prompt": "a prompt the cache holds " * 4, "max_tokens": 2, **GREEDY}
            client.generate(**cached)
            client.generate(**cached)
            wait_until(lambda: client.stats()["prompt_tokens_reused"] > 0, timeout_s=60.0)  # stats lag 0.25 s
            stream = client.stream(prompt="x", max_tokens=8000, **GREEDY)
            next(stream)
            os.kill(old_pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(CbatchError) as err:
                list(stream)
            assert err.value.code == "worker_restarted"
            assert time.monotonic() - started < 5.0  # told by the supervisor at once, not left waiting
            wait_until(lambda: client.health()["status"] == "ok", timeout_s=60)
            assert client.health()["worker_pid"] not in (old_pid, 0)
            again = client.generate(prompt="x", max_tokens=20, **GREEDY)
            assert len(again.token_ids) == 20
            client.generate(**cached)  # a new worker starts with an empty cache
            wait_until(lambda: client.stats()["requests_ended"] == 2, timeout_s=60.0)
            assert client.stats()["prompt_tokens_reused"] == 0
        assert not pid_alive(old_pid)
        assert "restarting" in d.log()
    finally:
        assert d.stop() == 0


def test_sigterm_drains_cancels_after_grace_and_refuses_new_work(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 16384), "--drain-grace", "1")
    ring_name, worker_pid = d.ring_name(), d.health["worker_pid"]
    with d.client() as client, d.client() as latecomer:
        stream = client.stream(prompt="x", max_tokens=16000, **GREEDY)
        next(stream)
        d.process.send_signal(signal.SIGTERM)
        wait_until(lambda: latecomer.health()["status"] == "draining", timeout_s=60.0)  # generous: a busy machine
        with pytest.raises(CbatchError) as err:
            latecomer.generate(prompt="late", max_tokens=3)
        assert err.value.code == "shutting_down"
        with pytest.raises(CbatchError) as ended:  # not `cancelled`: the caller did not cancel it
            list(stream)
        assert ended.value.code == "shutting_down" and "send it again" in ended.value.message
    assert d.stop() == 0
    wait_until(lambda: not pid_alive(worker_pid), 60)
    assert not os.path.exists(f"/dev/shm/{ring_name}")
    assert d.leftovers() == []


def test_sigterm_under_load_keeps_every_finished_result_and_ends_the_rest_per_item(tiny_model_path, start_daemon,
                                                                                  tmp_path):
    """A batch in flight when the daemon drains: what finished reaches the caller and the rest
    end with an error each; cbatch-submit writes what finished and holds the rest (a drain's
    refusal is not a result) until its --retry-for is spent, then says how to resume."""
    import json
    import threading

    d = start_daemon(tiny_model_path, "--parallel", "4", "--drain-grace", "5")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 60, **GREEDY}) + "\n" for i in range(300)))
    submit = subprocess.Popen([str(SCRIPTS_DIR / "cbatch-submit"), str(prompts), "-o", str(tmp_path / "out.jsonl"),
                               "--max-in-flight", "8", "--retry-for", "5"], env=d.env, stderr=subprocess.PIPE,
                              text=True)
    outcome = {}

    def run_batch():
        with d.client() as client:
            outcome["results"] = client.generate_batch(
                # at cbatch-submit's priority, so the two callers take turns in one queue
                [{"prompt": f"b{i}", "max_tokens": 60, "priority": "batch", **GREEDY} for i in range(300)],
                max_in_flight=8)

    batch = threading.Thread(target=run_batch)
    batch.start()
    output = tmp_path / "out.jsonl"
    with d.client() as watcher:  # let both callers finish some requests first
        wait_until(lambda: watcher.stats()["num_requests_ended"] >= 16 and output.exists()
                   and output.read_text().count("\n") >= 2, timeout_s=60)
    d.process.send_signal(signal.SIGTERM)
    batch.join(timeout=40)
    assert not batch.is_alive(), "generate_batch did not return after the daemon left"
    assert submit.wait(timeout=120) == EXIT_UNREACHABLE  # no daemon came back within --retry-for
    assert "--resume" in submit.stderr.read()
    assert d.stop() == 0
    results = outcome["results"]
    completed = [r for r in results if not isinstance(r, CbatchError)]
    codes = {r.code for r in results if isinstance(r, CbatchError)}
    assert len(results) == 300 and None not in results
    assert completed and all(c.usage["completion_tokens"] == 60 for c in completed)
    assert codes and codes <= {"shutting_down", "unavailable"}
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert 2 <= len(lines) < 300 and [line["id"] for line in lines] == list(range(1, len(lines) + 1))
    assert all("text" in line for line in lines)  # no line written as an error: --resume runs the rest


def test_sigint_lets_short_requests_finish(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "2")
    with d.client() as client:
        stream = client.stream(prompt="x", max_tokens=200, **GREEDY)
        next(stream)
        d.process.send_signal(signal.SIGINT)
        rest = list(stream)
    assert rest[-1].finish_reason == "length" and rest[-1].usage["completion_tokens"] == 200
    assert d.stop() == 0


def test_a_client_that_stops_reading_is_cut_off_without_costing_others(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "3", "--ctx-size", str(3 * 16384))
    with d.client(use_ring=False) as sleeper, d.client() as bystander:
        stalled = [sleeper.stream(prompt=f"flood {i}", max_tokens=15000, **GREEDY) for i in range(2)]
        watch = bystander.stream(prompt="steady", max_tokens=3000, **GREEDY)
        # The sleeper reads nothing while one RECORDS message per step piles up for it:
        # once ZeroMQ's queue to it is full the rest waits in the front-end's backlog,
        # and after MAX_STALL_S without taking anything the front-end cancels its
        # requests.
        # Its queues (ZeroMQ's and the kernel's socket buffer) fill at the pace of the steps:
        # a few thousand steps, slow on a busy machine.
        wait_until(lambda: bystander.stats()["num_requests_by_outcome"].get("cancelled", 0) == 2,
                   timeout_s=MAX_STALL_S + 400.0)
        chunks = list(watch)
        results = [list(s) for s in stalled]  # reading again: it recovers what it missed
    assert chunks[-1].finish_reason == "length" and len(sum((c.token_ids for c in chunks), [])) == 3000
    for result in results:
        assert result[-1].finish_reason == "cancelled"
        produced = result[-1].usage["completion_tokens"]
        # Cut off MAX_STALL_S after its queues (1000 messages each way) filled, before its 15000.
        assert 0 < produced < 15000 and len(sum((c.token_ids for c in result), [])) == produced


def test_sigterm_to_the_whole_process_group_still_drains(tiny_model_path):
    # As systemd's default stop does: the worker gets SIGTERM too and must leave the
    # shutdown to the supervisor, so the in-flight request still finishes.
    from daemonkit import Daemon

    d = Daemon(tiny_model_path, "--parallel", "2", start_new_session=True)
    try:
        with d.client() as client:
            stream = client.stream(prompt="x", max_tokens=300, **GREEDY)
            next(stream)
            os.killpg(d.process.pid, signal.SIGTERM)
            rest = list(stream)
        assert rest[-1].finish_reason == "length" and rest[-1].usage["completion_tokens"] == 300
        assert d.stop() == 0
        assert d.leftovers() == []
    finally:
        d.stop()
        d.remove_workdir()


@pytest.mark.parametrize("state", ["idle", "generating", "prefilling"])
def test_worker_exits_when_its_supervisor_is_killed(tiny_model_path, start_daemon, state):
    d = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 8192), "--batch-size", "2")
    worker_pid, ring_name = d.health["worker_pid"], d.ring_name()
    with d.client() as client:
        if state == "generating":
            streams = [client.stream(prompt="x", max_tokens=8000, **GREEDY) for _ in range(2)]
            [next(s) for s in streams]
        elif state == "prefilling":  # 2-token chunks of a long prompt: thousands of steps before a token
            stream = client.submit(prompt="y" * 8000, max_tokens=5, **GREEDY)
            wait_until(lambda: client.stats()["num_active"] == 1, timeout_s=60.0)  # the stats lag 0.25 s
            assert not stream.pending
        d.process.kill()
        d.process.wait()
        killed_at = time.monotonic()
        wait_until(lambda: not pid_alive(worker_pid), timeout_s=60.0)
        assert time.monotonic() - killed_at < 10.0  # it notices its parent gone by itself, not never
        if state == "generating":  # a client waiting on the dead daemon hears so within about 5 s
            waiting_since = time.monotonic()
            with pytest.raises(CbatchError) as err:
                list(streams[0])
            # About 5 s by the liveness rule; a busy machine adds.
            assert err.value.code == "unavailable" and time.monotonic() - waiting_since < 15.0
    wait_until(lambda: not os.path.exists(f"/dev/shm/{ring_name}"), timeout_s=60.0)
    # A daemon started where the killed one ran removes its socket files.
    assert d.leftovers()
    again = start_daemon(tiny_model_path, "--parallel", "2", workdir=d.workdir, endpoint=d.endpoint)
    assert again.stop() == 0
    assert again.leftovers() == [], again.log()


def test_hung_worker_is_killed_and_replaced(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 8192), "--worker-timeout", "2")
    old_pid = d.health["worker_pid"]
    with d.client() as client:
        stream = client.stream(prompt="x", max_tokens=8000, **GREEDY)
        next(stream)
        os.kill(old_pid, signal.SIGSTOP)  # alive but making no progress
        started = time.monotonic()
        with pytest.raises(CbatchError) as err:
            list(stream)
        assert err.value.code == "worker_restarted" and time.monotonic() - started < 10
        wait_until(lambda: client.health()["status"] == "ok", timeout_s=60)
        assert client.health()["worker_pid"] != old_pid
        assert len(client.generate(prompt="x", max_tokens=5, **GREEDY).token_ids) == 5
    assert "no step" in d.log()


FLOOD = """
import sys
from cbatch.client import Client
client = Client(sys.argv[1])
while True:
    client.submit(prompt="flood " * 20, max_tokens=200, temperature=0)
"""


def test_a_client_that_floods_submits_and_is_killed_cannot_take_the_daemon_down(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "2")
    for flood_s in (1.0, 2.5, 4.0):  # the abort came at varied points of the backlog
        flooder = subprocess.Popen([sys.executable, "-c", FLOOD, d.endpoint], env=d.env)
        time.sleep(flood_s)
        flooder.kill()
        flooder.wait()
        assert d.process.poll() is None, d.log()
        with d.client() as client:
            # What it sent before it died, even what was still queued, runs for nobody: the
            # front-end's in-flight count (the cancels' finishes come back from the worker).
            wait_until(lambda: client.stats()["num_in_flight"] == 0, timeout_s=60.0)
            assert len(client.generate(prompt="x", max_tokens=3, **GREEDY).token_ids) == 3
    assert "Assertion failed" not in d.log()


def test_the_daemon_takes_every_descriptor_its_hard_limit_allows(tiny_model_path, start_daemon):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))  # inherited by the daemon
    try:
        d = start_daemon(tiny_model_path, "--parallel", "1")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    limits = Path(f"/proc/{d.process.pid}/limits").read_text()
    line = next(row for row in limits.splitlines() if row.startswith("Max open files"))
    daemon_soft, daemon_hard = line.split()[3:5]
    assert daemon_soft == daemon_hard or (hard == resource.RLIM_INFINITY and int(daemon_soft) >= 1 << 20)


def test_late_messages_of_a_dead_worker_are_ignored(tiny_model_path, start_daemon):
    import zmq

    from cbatch.protocol import MsgType, pack

    d = start_daemon(tiny_model_path, "--parallel", "1")
    control = next(d.runtime_dir.glob("cbatch-*/cbatch-*-control.sock"))
    zctx = zmq.Context()
    stale = zctx.socket(zmq.DEALER)
    stale.setsockopt(zmq.LINGER, 0)
    stale.setsockopt(zmq.IDENTITY, b"worker-0")  # the routing id of a worker before this one
    stale.connect(f"ipc://{control}")
    try:
        with d.client() as client:
            request = client.submit(prompt="x", max_tokens=2000, **GREEDY)
            stream = client.read(request)
            first = next(stream)  # the request runs on the live worker: a stale finish would end it
            event = [request.request_id, 0, [1], "x", "stop", {"prompt_tokens": 1, "completion_tokens": 1}, None]
            stale.send_multipart(pack(MsgType.WORKER_EVENTS, {"events": [event]}))
            stale.send_multipart(pack(MsgType.WORKER_READY, {"pid": 1, "model": "stale", "ctx_per_seq": 16,
                                                               "prefix_cache": "off"}))
            chunks = [first, *stream]
            health = client.health()
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 2000
        assert len(sum((c.token_ids for c in chunks), [])) == 2000
        assert (health["worker_pid"], health["model"]) == (d.health["worker_pid"], d.health["model"])
    finally:
        zctx.destroy(linger=0)


def test_a_client_that_reads_late_loses_nothing_and_no_request_is_cancelled(tiny_model_path, start_daemon):
    """A relayed client with a tiny receive queue reads nothing while its four requests
    produce far more messages than ZeroMQ's queues hold; what does not fit waits in the
    front-end, merged per request. Reading again, it gets every token of every request,
    and nothing was cancelled (a client that multiplexes callers, like the HTTP server,
    must not lose all of them for a moment's delay)."""
    d = start_daemon(tiny_model_path, "--parallel", "4", "--ctx-size", str(4 * 2048))
    # 1600 records, past the queues, and done well inside the 10 s after which a client that
    # takes nothing is cut off, on a busy machine too
    num_tokens = 400
    with RawPeer(d.endpoint) as peer, d.client(use_ring=False) as watcher:
        peer.sock.setsockopt(zmq.RCVHWM, 10)
        request_ids = [9000 + i for i in range(4)]
        for request_id in request_ids:
            peer.send(MsgType.SUBMIT, {"request_id": request_id,
                                       "body": {"prompt": f"late {request_id}", "max_tokens": num_tokens, **GREEDY}})
        # Not reading until every request has finished: 4 x 400 records, against queues of
        # about 1000 messages.
        wait_until(lambda: watcher.stats()["num_requests_by_outcome"].get("length", 0) >= 4, timeout_s=60.0)
        records: dict[int, list] = {request_id: [] for request_id in request_ids}
        finishes: dict[int, dict] = {}
        while len(finishes) < len(request_ids):
            msg_type, body = peer.recv()
            if msg_type is MsgType.RECORDS:
                records[body["request_id"]] += body["records"]
            elif msg_type is MsgType.FINISHED:
                finishes[body["request_id"]] = body
        outcomes = watcher.stats()["num_requests_by_outcome"]
    for request_id in request_ids:
        assert finishes[request_id]["finish_reason"] == "length"
        assert [row[0] for row in records[request_id]] == list(range(finishes[request_id]["num_records"]))
        assert finishes[request_id]["usage"]["completion_tokens"] == num_tokens
    assert outcomes.get("cancelled", 0) == 0


@pytest.mark.parametrize("use_ring", [False, True], ids=["relayed", "ring"])
def test_a_reader_slower_than_the_model_gets_its_tokens_merged_and_all_of_them(tiny_model_path, start_daemon,
                                                                               use_ring):
    """A caller that keeps reading, only slower than the model writes, is never cut off
    and does not fall further behind: each chunk it takes holds every token that arrived
    since the last one, so its chunks are far fewer than its tokens, and they add up to
    the whole answer."""
    # A fixed thread count: the default drops to one thread while the host is busy, and the
    # tiny model's greedy answer is not the same past ~700 tokens on one thread as on two.
    d = start_daemon(tiny_model_path, "--parallel", "2", "--threads", "1")
    num_tokens, pause_s = 1500, 0.05  # one token per chunk would take 75 s
    with d.client(use_ring=use_ring) as client:
        whole = client.generate(prompt="a slow reader", max_tokens=num_tokens, **GREEDY)
        chunks = []
        for chunk in client.stream(prompt="a slow reader", max_tokens=num_tokens, **GREEDY):
            chunks.append(chunk)
            time.sleep(pause_s)
    assert [token for chunk in chunks for token in chunk.token_ids] == whole.token_ids
    assert "".join(chunk.text for chunk in chunks) == whole.text and chunks[-1].finish_reason == "length"
    assert len(chunks) < num_tokens / 10, len(chunks)


def test_a_reader_that_falls_far_behind_pauses_its_request_and_gets_every_token(tiny_model_path, start_daemon):
    """Back-pressure on one request: a relayed reader that pauses (shorter than the stall
    limit) while its request writes 20 log-probabilities a token lets its records pile up
    in the front-end; past the per-request bound the worker pauses that request (its stats
    say so) instead of buffering without end, a bystander's request runs to its end
    meanwhile, and once the reader catches up the request goes on and every token arrives."""
    d = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 10_000))
    num_tokens = 8000

    def num_paused() -> int:
        with d.client() as other:
            return other.stats()["num_paused"]

    saw_paused, chunks = False, []
    with d.client(use_ring=False) as client:
        for chunk in client.stream(prompt="a reader far behind", max_tokens=num_tokens, logprobs=20,
                                   **GREEDY):
            chunks.append(chunk)
            looked_until_s = time.monotonic() + MAX_STALL_S * 0.6  # never long enough to be cut off
            while not saw_paused and time.monotonic() < looked_until_s:
                saw_paused = num_paused() >= 1
                if saw_paused:
                    with d.client() as bystander:
                        assert bystander.generate(prompt="meanwhile", max_tokens=64, **GREEDY).finish_reason == "length"
                time.sleep(0.05)
    assert saw_paused
    assert chunks[-1].finish_reason == "length"
    assert sum(len(chunk.token_ids) for chunk in chunks) == num_tokens
    wait_until(lambda: num_paused() == 0, 30)
