"""One ring reader per client process, through the real daemon: many Clients in threads
share it, each gets exactly its own tokens (through ring overruns too), and a thread
waiting on a quiet request is not woken by other requests' steps."""

import gc
import threading

from cbatch.client.shared_ring import SharedRingReader
from daemonkit import wait_until
from common import GREEDY

NUM_THREADS = 12
RING_RECORDS = 64


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
            wait_until(lambda: watcher.stats()["num_steps"] >= before["num_steps"] + 3 * RING_RECORDS, timeout_s=30)
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
    wait_until(lambda: readers_of(ring_name) == [] and reader_threads() == threads_before, timeout_s=5.0)
