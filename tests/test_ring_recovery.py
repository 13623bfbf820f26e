"""Recovery of what the ring lost, through the real daemon: a reader the ring lapped
fetches the records it missed from the front-end (the stats count those FETCHes), and a
finished request's records stay fetchable for --retention seconds, then are gone."""

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time

from common import GREEDY
from daemonkit import RawPeer, wait_until

from cbatch.protocol import MsgType

RING_RECORDS = 8
# One sequence at a time and no prefix cache: every request is decoded alone and in full,
# the same batches whoever reads it, so a ring reader and a relayed one get the same tokens.
# Never parked: a request paused for the stopped reader while the others wait would give
# its slot up and be recomputed (no prefix cache) in batches of another shape. A fixed
# thread count: the default's governor changes it on a busy host, and with it how llama.cpp
# splits a step's sums, which can turn a long greedy output at a near-tie.
SOLO_ARGS = ("--parallel", "1", "--ctx-size", "4096", "--batch-size", "64", "--no-prefix-cache",
             "--park-after", "3600", "--threads", "1")


# A ring reader in its own process: it submits, says so once the daemon has its requests
# (a process stopped right after a send may hold it unsent), and reads only once told to
# (while it waits for that, the test stops the whole process, its ring-reading thread
# included, so that the ring laps it); then it prints what it read as JSON.
READER_SCRIPT = """
import json, sys
from cbatch import Client
endpoint, bodies = sys.argv[1], json.loads(sys.argv[2])
with Client(endpoint) as client:
    assert client.info["use_ring"]
    got = []
    for batch in bodies:
        streams = [client.submit(**body) for body in batch]
        client.stats()  # a round trip behind the submits on one socket: the daemon has them
        print("submitted", flush=True)
        sys.stdin.readline()
        for stream in streams:
            chunks = list(client.read(stream))
            got.append([sum((c.token_ids for c in chunks), []), "".join(c.text for c in chunks),
                        chunks[-1].finish_reason, chunks[-1].usage])
print(json.dumps(got), flush=True)
"""


def test_a_reader_the_ring_lapped_gets_every_token_once(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *SOLO_ARGS, "--ring-capacity", str(RING_RECORDS))
    running, *finished = [{"prompt": f"lapped {i}", "max_tokens": n, **GREEDY} for i, n in enumerate((2000, 150, 150))]
    with d.client(use_ring=False) as watcher:
        want = [watcher.generate(**body) for body in (running, *finished)]
        wait_until(lambda: watcher.stats()["num_active"] == 0, timeout_s=60.0)  # the idle worker's last figures
        before = watcher.stats()
        reader = subprocess.Popen([sys.executable, "-c", READER_SCRIPT, d.endpoint, json.dumps([[running], finished])],
                                  env=d.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            # Lapped mid-stream: the reader runs again after four laps, while the request still runs.
            assert reader.stdout.readline() == "submitted\n"
            with stopped(reader):
                wait_until(lambda: watcher.stats()["num_steps"] >= before["num_steps"] + 4 * RING_RECORDS,
                           timeout_s=60.0)
                assert watcher.stats()["num_in_flight"] == 1, "finished before the reader was lapped: raise max_tokens"
            reader.stdin.write("read\n")
            reader.stdin.flush()
            # Lapped for good: it runs again only once both have finished.
            assert reader.stdout.readline() == "submitted\n"
            with stopped(reader):
                wait_until(lambda: watcher.stats()["num_in_flight"] == 0, timeout_s=120.0)
            reader.stdin.write("read\n")
            reader.stdin.flush()
            got = json.loads(reader.stdout.readline())
            assert reader.wait(timeout=60) == 0
        finally:
            reader.kill()
            reader.wait()
        num_fetches = watcher.stats()["num_fetches"] - before["num_fetches"]

    for (token_ids, text, finish_reason, usage), relayed in zip(got, want, strict=True):
        assert (token_ids, text) == (relayed.token_ids, relayed.text)
        assert finish_reason == "length" and usage == relayed.usage
    assert num_fetches >= 3  # each of the three streams recovered over ZeroMQ


# generate() in its own process: its request is muted in the client's ring inbox (no
# wake-up until its end), and the ring laps it while it waits.
GENERATE_SCRIPT = """
import json, sys
from cbatch import Client
endpoint, body = sys.argv[1], json.loads(sys.argv[2])
with Client(endpoint) as client:
    assert client.info["use_ring"]
    print("generating", flush=True)
    reply = client.generate(**body)
print(json.dumps([reply.token_ids, reply.text, reply.finish_reason]), flush=True)
"""


def test_a_generate_the_ring_lapped_returns_every_token_once(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *SOLO_ARGS, "--ring-capacity", str(RING_RECORDS))
    body = {"prompt": "lapped while waiting whole", "max_tokens": 1000, **GREEDY}
    with d.client(use_ring=False) as watcher:
        want = watcher.generate(**body)
        wait_until(lambda: watcher.stats()["num_active"] == 0, timeout_s=60.0)
        before = watcher.stats()
        reader = subprocess.Popen([sys.executable, "-c", GENERATE_SCRIPT, d.endpoint, json.dumps(body)],
                                  env=d.env, stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdout.readline() == "generating\n"
            wait_until(lambda: watcher.stats()["num_in_flight"] == 1, timeout_s=60.0)
            with stopped(reader):  # mid-request: the ring laps it four times
                wait_until(lambda: watcher.stats()["num_steps"] >= before["num_steps"] + 4 * RING_RECORDS,
                           timeout_s=60.0)
                assert watcher.stats()["num_in_flight"] == 1, "finished before the reader was lapped: raise max_tokens"
            token_ids, text, finish_reason = json.loads(reader.stdout.readline())
            assert reader.wait(timeout=60) == 0
        finally:
            reader.kill()
            reader.wait()
        assert watcher.stats()["num_fetches"] > before["num_fetches"]  # recovered over ZeroMQ
    assert (token_ids, text, finish_reason) == (want.token_ids, want.text, "length")


@contextlib.contextmanager
def stopped(process: subprocess.Popen):
    """The process is stopped (SIGSTOP, as a debugger or a swapped-out host would) meanwhile."""
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


def run_to_finish(peer: RawPeer, body: dict) -> tuple[int, list, dict]:
    """Submit over the bare protocol; the request id, its relayed records and its finish."""
    request_id = secrets.randbits(62) + 1
    peer.send(MsgType.SUBMIT, {"request_id": request_id, "body": body})
    before, finish = peer.recv_until(MsgType.FINISHED)
    assert [msg_type for msg_type, _ in before] == [MsgType.RECORDS] * len(before)
    records = [row for _, message in before for row in message["records"]]
    assert len(records) == finish["num_records"]
    return request_id, records, finish


def fetch(peer: RawPeer, request_id: int) -> tuple[MsgType, dict]:
    peer.send(MsgType.FETCH, {"request_id": request_id, "from_index": 0})
    return peer.recv()


RETENTION_S = 3.0  # long enough that a busy machine fetches before it ends
BODY = {"prompt": "kept a while", "max_tokens": 12, **GREEDY}


def test_records_are_fetchable_during_retention_and_gone_after_it(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *SOLO_ARGS, "--retention", str(RETENTION_S))
    with RawPeer(d.endpoint) as peer:
        first_id, records, _ = run_to_finish(peer, BODY)
        finished_at = time.monotonic()
        assert fetch(peer, first_id) == (MsgType.RECORDS, {"request_id": first_id, "records": records})
        time.sleep(max(0.0, finished_at + RETENTION_S + 0.2 - time.monotonic()))  # retention is a time
        second_id, second_records, _ = run_to_finish(peer, BODY)  # the daemon is busy after it
        msg_type, reply = fetch(peer, first_id)
        assert msg_type is MsgType.ERROR and reply["code"] == "not_found", reply
        assert fetch(peer, second_id) == (MsgType.RECORDS, {"request_id": second_id, "records": second_records})


def test_records_expire_on_an_idle_daemon(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *SOLO_ARGS, "--retention", str(RETENTION_S))
    with RawPeer(d.endpoint) as peer:
        request_id, _, _ = run_to_finish(peer, BODY)
        time.sleep(RETENTION_S + 0.2)
        msg_type, reply = fetch(peer, request_id)
    assert msg_type is MsgType.ERROR and reply["code"] == "not_found", reply
