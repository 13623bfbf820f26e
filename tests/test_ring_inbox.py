"""The session's inbox from the shared ring reader: its wake pipe is readable exactly
while something waits to be drained, whatever the filling and draining threads do."""

import select
import threading

from cbatch.client.ring_inbox import RingInbox

NUM_PUTS = 20_000


def is_readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_the_wake_pipe_is_readable_only_while_rows_wait():
    inbox = RingInbox()
    try:
        def fill():
            for i in range(NUM_PUTS):
                inbox.put({1: [(i, i, 0, 0, 1, "")]})

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
