"""A daemon out of descriptors refuses new clients and keeps serving the ones it has."""

import os
import resource
import sys
import time

import zmq
from common import GREEDY
from daemonkit import pid_alive, wait_until

from cbatch.errors import CbatchError
from cbatch.protocol import PROTOCOL_VERSION, MsgType, pack, unpack

LIMIT = 64  # about 24 are the daemon's own: libzmq aborted it at the 41st client
NUM_CLIENTS = 24  # about 10 fit under LIMIT; the old code refused none
REFUSE_TIMEOUT_S = 5.0  # a busy machine welcomes late; a refusal comes at once
NUM_BURST = 200  # connects at once, five times what libzmq aborted the daemon at
BURST_TIMEOUT_S = 60.0  # for every one of them to be welcomed or refused


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
                assert err.code == "unavailable" and "no room for another client" in err.message, err.message
                assert time.monotonic() - started < 2 * REFUSE_TIMEOUT_S
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
    wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= held, timeout_s=60.0)
    with d.client() as client:
        assert len(client.generate(prompt="y", max_tokens=3, **GREEDY).token_ids) == 3
    first.close()
    assert d.stop() == 0, d.log()
    assert "Assertion failed" not in d.log()
    assert d.leftovers() == []



def _under_hard_limit(limit: int, soft_limit: int | None = None) -> list[str]:
    """cbatch-worker's main, in a process whose open-file hard limit is `limit` (and soft
    limit `soft_limit`, else the same)."""
    soft = limit if soft_limit is None else soft_limit
    return [sys.executable, "-c", f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {limit})); "
                                  "from cbatch.workers.daemon.main import main; main()"]


def test_the_daemon_takes_every_descriptor_its_hard_limit_allows(tiny_model_path, start_daemon):
    own_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 4096 if own_hard == resource.RLIM_INFINITY else min(4096, own_hard)  # within what this process may set
    d = start_daemon(tiny_model_path, "--parallel", "1", launcher=_under_hard_limit(hard, soft_limit=LIMIT))
    assert resource.prlimit(d.process.pid, resource.RLIMIT_NOFILE) == (hard, hard)


def test_a_hard_limit_too_low_for_the_queue_is_named_at_start(tiny_model_path, start_daemon):
    low = start_daemon(tiny_model_path, "--parallel", "2", "--max-queue", "1024", launcher=_under_hard_limit(256))
    assert "open-file hard limit is 256, under the" in low.log()
    enough = start_daemon(tiny_model_path, "--parallel", "2", "--max-queue", "16", launcher=_under_hard_limit(256))
    assert "open-file hard limit" not in enough.log()


def test_a_burst_of_connects_under_a_low_hard_limit_is_refused_and_the_daemon_serves_on(tiny_model_path,
                                                                                         start_daemon):
    """libzmq accepts on its own thread, hundreds in a millisecond, and aborted the daemon at
    the first accept that found no descriptor. Now it accepts one at a time while there is
    room: each connect is welcomed or refused with the reason, and the daemon serves on."""
    d = start_daemon(tiny_model_path, "--parallel", "1", launcher=_under_hard_limit(LIMIT))
    pid = d.process.pid
    held = len(os.listdir(f"/proc/{pid}/fd"))
    zctx = zmq.Context()
    peers = []
    for _ in range(NUM_BURST):  # each queues its HELLO at once, as a client does
        peer = zctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(d.endpoint)
        peer.send_multipart(pack(MsgType.HELLO, {"version": PROTOCOL_VERSION, "use_ring": False}))
        peers.append(peer)
    welcomed, refusals = [], []
    try:
        deadline = time.monotonic() + BURST_TIMEOUT_S
        waiting = list(peers)
        while waiting and time.monotonic() < deadline:
            zmq.select(waiting, [], [], 0.1)
            for peer in [p for p in waiting if p.poll(0)]:
                waiting.remove(peer)
                msg_type, body = unpack(peer.recv_multipart())
                if msg_type is MsgType.WELCOME:
                    welcomed.append(peer)
                else:  # a refused client closes, as the client library does
                    refusals.append(body)
                    peer.close()
            assert pid_alive(pid), d.log()
        assert not waiting, f"{len(waiting)} connects got no answer"
        assert 1 <= len(welcomed) < NUM_BURST // 4 and len(refusals) == NUM_BURST - len(welcomed)
        assert {r["code"] for r in refusals} == {"unavailable"}
        assert "no room for another client" in refusals[0]["message"] and f"limit of {LIMIT}" in refusals[0]["message"]
    finally:
        zctx.destroy(linger=0)
    wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= held, timeout_s=60.0)
    with d.client() as client:
        assert len(client.generate(prompt="after the burst", max_tokens=3, **GREEDY).token_ids) == 3
    assert d.stop() == 0, d.log()
    assert "Too many open files" not in d.log() and "cannot pace" not in d.log()
    assert d.leftovers() == []
