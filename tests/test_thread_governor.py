"""The compute threads drop to one while other processes take the cores, and the configured
count is tried again later, kept once the host is quiet. No model here: the readings are fed."""

from cbatch.workers.engine.thread_governor import FIRST_PROBE_S, NUM_SAMPLES, ThreadGovernor


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def governed():
    clock, counts, lines = Clock(), [], []
    governor = ThreadGovernor(2, counts.append, lines.append, clock)
    return governor, clock, counts, lines


def feed(governor, share: float, num: int = NUM_SAMPLES) -> None:
    for _ in range(num):
        governor.on_share(share)
        governor.on_step()


def test_a_quiet_host_keeps_every_thread():
    governor, clock, counts, lines = governed()
    for _ in range(20):
        feed(governor, 0.97)
        clock.now_s += 60
    assert governor.num_threads == 2 and counts == [] and lines == []


def test_a_busy_host_drops_to_one_thread_and_tries_again_later():
    governor, clock, counts, lines = governed()
    feed(governor, 0.95, NUM_SAMPLES - 1)
    feed(governor, 0.3, 1)  # one slow reading among good ones: the mean holds
    assert governor.num_threads == 2
    feed(governor, 0.45)
    assert counts == [1] and governor.num_threads == 1 and "decoding with 1 thread instead of 2" in lines[-1]
    clock.now_s += FIRST_PROBE_S - 1
    feed(governor, 0.6)  # one thread gets what it can; no change before the probe
    assert counts == [1]
    clock.now_s += 1
    governor.on_step()
    assert counts == [1, 2]
    feed(governor, 0.4)  # still busy: back to one, the next probe twice as far
    assert counts == [1, 2, 1] and f"again in {2 * FIRST_PROBE_S:.0f} s" in lines[-1]
    clock.now_s += 2 * FIRST_PROBE_S
    governor.on_step()
    feed(governor, 0.95)  # the host is quiet again: the configured count stays
    assert counts == [1, 2, 1, 2] and governor.num_threads == 2 and "2 threads again" in lines[-1]
    clock.now_s += 1000
    feed(governor, 0.95)
    assert counts == [1, 2, 1, 2]
