"""The session's inbox from the shared ring reader: its wake pipe is readable exactly
while something waits to be drained, whatever the filling and draining threads do."""

import select
import threading

import pytest

from cbatch.client.ring_inbox import RingInbox

NUM_PUTS = 20_000


def is_readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


@pytest.mark.parametrize("is_mixed", [False, True], ids=["one request", "beside a muted one"])
def test_the_wake_pipe_is_readable_only_while_rows_wait(is_mixed):
    inbox = RingInbox()
    inbox.set_muted(3, True)  # with is_mixed, every other put is its: rows that wake nobody
    try:
        def fill():
            for i in range(NUM_PUTS):
                inbox.put({3 if is_mixed and i % 2 else 1: [(i, i, 0, 0, 1, "")]})

        filler = threading.Thread(target=fill)
        filler.start()
        num_rows, num_checked = 0, 0
        while filler.is_alive():
            num_rows += sum(len(rows) for rows in inbox.drain()[0].values())
            with inbox._lock:  # the invariant, seen where no put or drain is halfway
                assert is_readable(inbox.wake_fd) == inbox._is_woken, f"after {num_rows} rows"
            num_checked += 1
        filler.join()
        assert num_checked > 1
        num_rows += sum(len(rows) for rows in inbox.drain()[0].values())
        assert num_rows == NUM_PUTS
        # Nothing waits now: a byte left in the pipe would wake a driver's event loop forever.
        assert not is_readable(inbox.wake_fd)
        inbox.put({2: [(0, 0, 0, 0, 1, "")]})
        assert is_readable(inbox.wake_fd)
        assert inbox.drain()[0] == {2: [(0, 0, 0, 0, 1, "")]}
        assert not is_readable(inbox.wake_fd)
    finally:
        inbox.close()


def test_a_muted_requests_rows_wake_nobody_and_are_drained_all_the_same():
    inbox = RingInbox()
    try:
        inbox.set_muted(1, True)
        inbox.put({1: [(0, 5, 0, 0, 1, "a")]})
        assert not is_readable(inbox.wake_fd)  # a generate() waiting for its end is not woken a step
        inbox.put({1: [(1, 6, 0, 0, 1, "b")]})
        assert inbox.drain()[0] == {1: [(0, 5, 0, 0, 1, "a"), (1, 6, 0, 0, 1, "b")]}  # a FINISHED drains them
        assert inbox.drain()[0] == {} and not is_readable(inbox.wake_fd)
        inbox.put({1: [(2, 7, 0, 0, 1, "")], 2: [(0, 8, 0, 0, 1, "")]})  # beside a request that streams
        assert is_readable(inbox.wake_fd)
        assert set(inbox.drain()[0]) == {1, 2} and not is_readable(inbox.wake_fd)
        inbox.put({}, gapped_ids=[1])  # missing records must be fetched: that wakes
        assert is_readable(inbox.wake_fd)
        assert inbox.drain()[1] == {1}
        inbox.set_muted(1, False)  # unwatched: the id is forgotten
        inbox.put({1: [(3, 9, 0, 0, 1, "")]})
        assert is_readable(inbox.wake_fd)
    finally:
        inbox.close()
