"""The HTTP server process: `cbatch-worker --http [HOST:]PORT` runs it beside the front-end
(`python -m cbatch.http_api.server`) on the socket the daemon bound, from before the model
loads (503 until the daemon is ready), restarted if it dies. It serves the routes of
cbatch/http_api/app.py under uvicorn. On SIGTERM it drains: new requests get 503,
in-flight responses finish, then it exits; it drains too when the daemon that started it
is gone.
"""

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket

import uvicorn

from cbatch.http_api.app import make_app
from cbatch.http_api.auth import API_KEY_ENV, API_KEYS_FILE_ENV, ApiKeys
from cbatch.http_api.body_limit import DEFAULT_MAX_BODY_BYTES
from cbatch.http_api.connection import choose_event_loop, timed_protocol
from cbatch.http_api.state import HttpState
from cbatch.jobs.batches import BatchStore

PARENT_POLL_S = 0.5  # how often the server checks that the daemon that started it lives
DRAIN_POLL_S = 0.05  # while draining, how often it checks whether the last response ended


class DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT start a drain (503 for new requests) instead of closing the socket;
    the server exits once no response is in flight."""

    def __init__(self, config: uvicorn.Config, state: HttpState):
        super().__init__(config)
        self.state = state
        self._drain_asked = asyncio.Event()  # wakes the watch at once: an idle drain ends at once
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig, frame) -> None:
        self.state.is_draining = True
        if self._loop is not None:  # a signal handler: it may run outside the loop's thread
            self._loop.call_soon_threadsafe(self._drain_asked.set)

    async def _watch(self, parent_pid: int) -> None:
        self._loop = asyncio.get_running_loop()
        def is_daemon_alive() -> bool:
            return os.getppid() == parent_pid

        while not self.should_exit:
            # A killed daemon breaks the connection too: reconnecting must give up then, or
            # this server would wait for it forever, holding the port a new daemon needs.
            await self.state.replace_broken_client(is_daemon_alive)
            if not is_daemon_alive():  # the daemon is gone: nothing left to serve
                self.state.is_draining = True
            if self.state.is_draining and self.state.num_in_flight == 0:
                self.should_exit = True
            if self.state.is_draining:  # the event stays set: waiting on it would not sleep
                await asyncio.sleep(DRAIN_POLL_S)
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._drain_asked.wait(), PARENT_POLL_S)

    async def run_all(self, sock: socket.socket, parent_pid: int) -> None:
        """Serve at once (503 until the daemon is reached and ready) while connecting."""
        connect = asyncio.create_task(self.state.connect())
        watch = asyncio.create_task(self._watch(parent_pid))
        try:
            await self.serve(sockets=[sock])
        finally:
            connect.cancel()
            watch.cancel()
            if self.state.client is not None:
                await self.state.client.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="cbatch-http")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--fd", type=int, required=True, help="the listening socket, bound by the daemon")
    parser.add_argument("--model-id", action="append", required=True, dest="model_names",
                        help="a name the model is served under, the first the default (repeatable)")
    parser.add_argument("--state-dir", help="the daemon's files and batch jobs (cbatch.jobs)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="the largest request body read (body_limit.py)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    state = HttpState(args.endpoint, args.model_names)
    store = BatchStore(args.state_dir) if args.state_dir else None
    api_key, keys_file = os.environ.pop(API_KEY_ENV, ""), os.environ.pop(API_KEYS_FILE_ENV, "")  # not inherited
    api_keys = ApiKeys(api_key, keys_file) if api_key or keys_file else None
    if api_keys is not None:  # the daemon forwards its SIGHUP: read the keys file again
        signal.signal(signal.SIGHUP, lambda signum, frame: api_keys.reload())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # started blocked: one sent meanwhile comes now
    app = make_app(state, api_keys, store, args.max_body_bytes)
    config = uvicorn.Config(app, http=timed_protocol(), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5)
    server = DrainingServer(config, state)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which drains us with SIGTERM
    choose_event_loop()
    asyncio.run(server.run_all(socket.socket(fileno=args.fd), os.getppid()))


if __name__ == "__main__":
    main()
