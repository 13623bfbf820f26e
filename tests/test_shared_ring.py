"""One ring reader per client process, through the real daemon: many Clients in threads
share it, each gets exactly its own tokens (through ring overruns too), and a thread
waiting on a quiet request is not woken by other requests' steps."""

import gc
import json
import os
import subprocess
import sys
import threading

import pytest
from common import GREEDY
from daemonkit import wait_until
from ringkit import publish

from cbatch.client.ring_inbox import RingInbox
from cbatch.client.shared_ring import RingTap, SharedRingReader
from cbatch.client.streams import RequestStream
from cbatch.ipc.ring import RingWriter, create_ring

NUM_THREADS = 12
RING_RECORDS = 64
CHILD_TIMEOUT_S = 90.0  # a deadlocked child is killed here


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cbatch-ring-reader"]


def readers_of(ring_name: str) -> list[SharedRingReader]:
    """This process's readers of one ring (other tests' clients may read other rings)."""
    return [reader for (_, name), reader in SharedRingReader._instances.items() if name == ring_name]


def test_client_threads_share_one_reader_and_each_gets_its_own_tokens_through_overruns(tiny_model_path,
                                                                                         start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "8", "--ring-capacity", str(RING_RECORDS))
    results: dict[int, list] = {}
    threads_before = reader_threads()
    is_started = threading.Barrier(NUM_THREADS + 1)

    def run(i: int) -> None:
        with d.client() as client:
            assert client.info["use_ring"]
            # Distinct lengths: a record handed to the wrong request would show in its count.
            stream = client.stream(prompt=f"thread {i}", max_tokens=200 + 7 * i, **GREEDY)
            first = next(stream)
            is_started.wait()
            results[i] = [first, *stream]

    with d.client(use_ring=False) as watcher:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(NUM_THREADS)]
        for t in threads:
            t.start()
        is_started.wait(timeout=60)
        (reader,) = readers_of(d.ring_name())  # twelve clients, one reader
        assert len(reader_threads()) == len(threads_before) + 1
        before = watcher.stats()
        # Hold the shared reader for several laps of the ring: every reader thread's
        # requests lose records, which their sessions recover over ZeroMQ.
        with reader._lock:
            wait_until(lambda: watcher.stats()["num_steps"] >= before["num_steps"] + 3 * RING_RECORDS, timeout_s=120)
        for t in threads:
            t.join(timeout=60)
        num_fetches = watcher.stats()["num_fetches"] - before["num_fetches"]

    assert sorted(results) == list(range(NUM_THREADS))
    for i, chunks in results.items():
        token_ids = sum((c.token_ids for c in chunks), [])
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 200 + 7 * i
        assert len(token_ids) == 200 + 7 * i
    assert num_fetches >= 1  # the overrun really happened and was recovered
    assert readers_of(d.ring_name()) == [] and reader_threads() == threads_before  # the last close stopped it


def test_a_thread_waiting_on_a_quiet_request_is_not_woken_by_other_requests(tiny_model_path, start_daemon):
    """One slot: the quiet request waits in the queue while another streams 400 steps.
    The shared reader puts nothing in the quiet client's inbox meanwhile (each put would
    wake its thread); once its request runs, its records arrive."""
    d = start_daemon(tiny_model_path, "--parallel", "1")
    with d.client() as busy, d.client() as quiet:
        busy_stream = busy.stream(prompt="busy", max_tokens=400, **GREEDY)
        num_busy_tokens = len(next(busy_stream).token_ids)
        inbox = quiet._session._ring._inbox
        num_puts = []
        original_put = inbox.put
        inbox.put = lambda *args, **kwargs: (num_puts.append(1), original_put(*args, **kwargs))
        quiet_stream = quiet.submit(prompt="quiet", max_tokens=20, **GREEDY)
        num_puts_while_quiet = None
        for chunk in busy_stream:
            num_busy_tokens += len(chunk.token_ids)
            if num_busy_tokens >= 300 and num_puts_while_quiet is None:  # the busy one still runs
                num_puts_while_quiet = len(num_puts)
        quiet_chunks = list(quiet.read(quiet_stream))
    assert num_busy_tokens == 400
    assert num_puts_while_quiet == 0
    assert len(num_puts) >= 1 and quiet_chunks[-1].usage["completion_tokens"] == 20


def test_a_client_dropped_without_close_gives_the_reader_back(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path)
    ring_name = d.ring_name()
    threads_before = reader_threads()
    client = d.client()
    assert client.generate(prompt="x", max_tokens=2).usage["completion_tokens"] == 2
    assert len(readers_of(ring_name)) == 1
    del client
    gc.collect()
    wait_until(lambda: readers_of(ring_name) == [] and reader_threads() == threads_before, timeout_s=60.0)


# Run in a child process, since the bug it checks for is a deadlock: a client that still
# watches a request is dropped in a reference cycle, and the collector runs on the reader
# thread inside pump() (the first put into another client's inbox), with the reader's
# lock held. Its finalizer must neither take that lock again nor wait for the thread.
_COLLECTED_ON_THE_READER_THREAD = """
import gc, json, threading, time
import cbatch
from cbatch.client.shared_ring import SharedRingReader

gc.disable()
dropped = cbatch.Client()
dropped_id = dropped.submit(prompt="dropped", max_tokens=4000, temperature=0, ignore_eos=True).request_id
dropped.cycle = dropped
del dropped
trigger = cbatch.Client()
(reader,) = SharedRingReader._instances.values()
collected_on = []
inbox = trigger._session._ring._inbox
original_put = inbox.put

def put(*args, **kwargs):
    if not collected_on and threading.current_thread().name == "cbatch-ring-reader":
        collected_on.append(gc.collect())  # the dropped client's finalizer runs here
    original_put(*args, **kwargs)

inbox.put = put
result = trigger.generate(prompt="trigger", max_tokens=40, temperature=0, ignore_eos=True)
deadline = time.monotonic() + 10
while (reader._num_users != 1 or dropped_id in reader._inbox_of) and time.monotonic() < deadline:
    time.sleep(0.01)
num_users, is_dropped_watched = reader._num_users, dropped_id in reader._inbox_of
trigger.close()
print(json.dumps({"collected": collected_on, "num_tokens": len(result.token_ids), "num_users": num_users,
                  "is_dropped_watched": is_dropped_watched, "readers_left": len(SharedRingReader._instances),
                  "reader_alive": reader._thread.is_alive()}))
"""


def test_a_client_collected_on_the_reader_thread_while_it_reads_gives_the_reader_back(tiny_model_path,
                                                                                        start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "2")
    child = subprocess.run([sys.executable, "-c", _COLLECTED_ON_THE_READER_THREAD], env=d.env,
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, child.stderr
    outcome = json.loads(child.stdout)
    assert outcome["collected"] and outcome["collected"][0] > 0  # the cycle was collected on the reader thread
    assert outcome["num_tokens"] == 40
    # The reader thread applied the collected client's give-back; the last close stopped it.
    assert outcome["num_users"] == 1 and not outcome["is_dropped_watched"]
    assert outcome["readers_left"] == 0 and not outcome["reader_alive"]


def test_a_request_carried_over_from_the_relay_reads_what_the_ring_got_before_it_was_watched(tmp_path):
    """A daemon restarted on the endpoint relays a session's requests until its HELLO, then
    stops relaying: the ring tap made then must read the records published in between,
    not start at the ring's present and fetch them again over ZeroMQ."""
    ring = create_ring(f"cbatch-test-carried-{os.getpid()}", 64)
    try:
        writer = RingWriter(ring)
        publish(writer, 9, 0, [5, 6, 7])  # another request's records: read past, not delivered
        for index in range(6):  # 0-2 were relayed; 3-5 reached only the ring
            publish(writer, 7, index, [100 + index])
        carried = RequestStream(request_id=7, label=0, next_index=3)
        tap = RingTap(ring.name, f"ipc://{tmp_path / 'tick.sock'}", [carried])
        try:
            rows, gapped_ids, error = tap.take(is_pumped=True)
        finally:
            tap.close()
    finally:
        ring.close()
        ring.unlink()
    assert error is None and not gapped_ids
    assert [(index, token_id) for index, token_id, *_ in rows[7]] == [(3, 103), (4, 104), (5, 105)]


def test_a_tap_collected_after_its_reader_stopped_closes_its_inbox_and_writes_nowhere(tmp_path):
    """A finalizer may run long after the reader thread ended (a client of an earlier daemon,
    collected later on any thread): it must neither write to the closed wake pipe, whose
    descriptor number a new pipe may hold by then, nor leave its inbox's pipe open."""
    ring = create_ring(f"cbatch-test-late-{os.getpid()}", 64)
    try:
        tap = RingTap(ring.name, f"ipc://{tmp_path / 'tick.sock'}")
        reader = tap._reader
        tap.close()  # the last user: the reader thread ends and closes its pipe
        assert not reader._thread.is_alive()
        read_fd, write_fd = os.pipe()  # takes the lowest free numbers: the reader's old ones
        os.set_blocking(read_fd, False)
        late_inbox = RingInbox()
        try:
            reader.depart_later(late_inbox, [7])
            with pytest.raises(BlockingIOError):
                os.read(read_fd, 1)  # nothing was written into the pipe that reused the numbers
        finally:
            os.close(read_fd)
            os.close(write_fd)
        with pytest.raises(OSError):
            os.fstat(late_inbox.wake_fd)  # the late departure closed its inbox
    finally:
        ring.close()
        ring.unlink()
