"""Recovery of what the ring lost, through the real daemon: a reader the ring lapped
fetches the records it missed from the front-end (the stats count those FETCHes), and a
finished request's records stay fetchable for --retention seconds, then are gone."""

import secrets
import time

from cbatch.protocol import MsgType
from daemonkit import RawPeer, wait_until
from common import GREEDY

RING_RECORDS = 8
# One sequence at a time and no prefix cache: every request is decoded alone and in full,
# the same batches whoever reads it, so a ring reader and a relayed one get the same tokens.
SOLO_ARGS = ("--parallel", "1", "--ctx-size", "4096", "--batch-size", "64", "--no-prefix-cache")


def test_a_reader_the_ring_lapped_gets_every_token_once(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *SOLO_ARGS, "--ring-capacity", str(RING_RECORDS))
    running, *finished = [{"prompt": f"lapped {i}", "max_tokens": n, **GREEDY} for i, n in enumerate((2000, 150, 150))]
    with d.client(use_ring=False) as watcher, d.client() as reader:
        assert reader.info["use_ring"]
        want = [watcher.generate(**body) for body in (running, *finished)]
        wait_until(lambda: watcher.stats()["num_active"] == 0, timeout_s=5.0)  # the idle worker's last figures
        before = watcher.stats()

        # Lapped mid-stream: the first read comes after four laps, while the request still runs.
        stream = reader.submit(**running)
        wait_until(lambda: watcher.stats()["num_steps"] >= before["num_steps"] + 4 * RING_RECORDS, timeout_s=10.0)
        assert watcher.stats()["num_in_flight"] == 1, "finished before the reader was lapped: raise max_tokens"
        got = [list(reader.read(stream))]

        # Lapped for good: read only once both have finished.
        streams = [reader.submit(**body) for body in finished]
        wait_until(lambda: watcher.stats()["num_in_flight"] == 0, timeout_s=30.0)
        got += [list(reader.read(s)) for s in streams]
        num_fetches = watcher.stats()["num_fetches"] - before["num_fetches"]

    for chunks, relayed in zip(got, want, strict=True):
        assert sum((c.token_ids for c in chunks), []) == relayed.token_ids
        assert "".join(c.text for c in chunks) == relayed.text
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage == relayed.usage
    assert num_fetches >= 3  # each of the three streams recovered over ZeroMQ


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


RETENTION_S = 1.0
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
