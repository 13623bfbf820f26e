"""A client that goes away for a moment (a paused process, a network blip) and comes back
under its routing id keeps its requests: what they produced meanwhile is delivered."""

import json
import signal
import subprocess
import sys
import time

from common import GREEDY, free_port
from daemonkit import wait_until

NUM_TOKENS = 3000


def test_a_paused_tcp_client_gets_every_token_of_its_requests(tiny_model_path, start_daemon):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 4096), endpoint=endpoint)
    paused = subprocess.Popen([sys.executable, "-c", (
        "import json, cbatch; c = cbatch.Client(); "
        f"streams = [c.stream(prompt=f'paused {{i}}', max_tokens={NUM_TOKENS}, **{GREEDY!r}) for i in range(2)]; "
        "first = next(streams[0]); print('streaming', flush=True); "
        "chunks = [[first] + list(streams[0]), list(streams[1])]; "
        "print(json.dumps([[len(sum((c.token_ids for c in s), [])), s[-1].finish_reason] for s in chunks]))")],
        env=d.env, stdout=subprocess.PIPE, text=True)
    try:
        assert paused.stdout.readline().strip() == "streaming"
        paused.send_signal(signal.SIGSTOP)
        # Past libzmq's heartbeat timeout (3 s): the daemon sees the connection die, and has
        # long looked at the client process (stopped: it may come back) when it resumes.
        time.sleep(8.0)
        paused.send_signal(signal.SIGCONT)
        out, _ = paused.communicate(timeout=600)  # generous: 6000 tokens on a machine that may be busy
    finally:
        paused.kill()
        paused.wait()
    results = json.loads(out.strip().splitlines()[-1])
    assert results == [[NUM_TOKENS, "length"], [NUM_TOKENS, "length"]], d.log()
    with d.client() as client:
        assert client.stats()["num_requests_by_outcome"].get("cancelled", 0) == 0


def test_a_tcp_client_that_closes_cancels_its_running_requests(tiny_model_path, start_daemon):
    """The daemon keeps a vanished tcp client's requests for its reconnect grace, as it
    cannot tell a closed client from a paused one; a client that closes says so."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = start_daemon(tiny_model_path, "--parallel", "2", "--reconnect-grace", "60", endpoint=endpoint)
    import cbatch

    for closing, num_cancelled in (("sync", 2), ("async", 3)):
        if closing == "sync":
            client = cbatch.Client(endpoint)
            streams = [client.stream(prompt=f"closing {i}", max_tokens=100_000, **GREEDY) for i in range(2)]
            next(streams[0])
            client.close()
        else:
            async def open_and_close():
                client = await cbatch.AsyncClient.connect(endpoint)
                stream = client.stream(prompt="closing async", max_tokens=100_000, **GREEDY)
                await stream.__anext__()
                await client.close()

            import asyncio
            asyncio.run(open_and_close())
        with d.client() as watcher:  # well within the grace
            wait_until(lambda: watcher.stats()["num_requests_by_outcome"].get("cancelled") == num_cancelled, 30.0)
            assert watcher.stats()["num_in_flight"] == 0
