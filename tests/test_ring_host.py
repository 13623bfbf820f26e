"""The ring's lock-free protocol relies on x86-64's memory ordering: on any other CPU the
daemon offers no ring, and local clients get their records relayed over ZeroMQ."""

import sys

from common import GREEDY

# cbatch-worker's main, in a process that reports another machine (an ARM host).
ON_AARCH64 = [sys.executable, "-c", "import platform; platform.machine = lambda: 'aarch64'; "
                                    "from cbatch.workers.daemon.main import main; main()"]


def test_off_x86_64_a_local_client_is_relayed_instead_of_reading_the_ring(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "2", launcher=ON_AARCH64)
    with d.client(use_ring=True) as client:
        assert client.info["use_ring"] is False and client.info["ring_name"] == ""
        reply = client.generate(prompt="relayed", max_tokens=40, **GREEDY)
    assert reply.finish_reason == "length" and len(reply.token_ids) == 40


def test_on_x86_64_a_local_client_reads_the_ring(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "2")
    with d.client(use_ring=True) as client:
        assert client.info["use_ring"] is True and client.info["ring_name"]
