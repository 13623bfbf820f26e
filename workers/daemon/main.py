"""cbatch-worker: the daemon (a front-end, the decode worker and, with --http, the HTTP server).

This module imports next to nothing before main() runs: from main's first line, a Ctrl-C
(or a SIGTERM) while the daemon parses its flags and imports itself (seconds) ends it
with one line; the daemon's own handlers take over before it creates anything.
"""

import sys

from cbatch.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, CbatchError

PROG = "cbatch-worker"


def main(argv=None) -> None:
    config = lock_fd = None
    try:
        import signal

        signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stop while it starts, as Ctrl-C
        from cbatch.cli.common import exit_with
        from cbatch.workers.daemon.endpoint_lock import lock_endpoint, release_endpoint
        from cbatch.workers.daemon.flags import warn_if_no_gpu

        args, config = _args_and_config(argv)
        try:  # before the seconds of importing the rest: a client started beside this one waits for it
            lock_fd = lock_endpoint(config.endpoint)
        except CbatchError as err:
            exit_with(PROG, err.message, EXIT_FAILED)
        from cbatch.workers.daemon.http_manager import listen_http
        from cbatch.workers.daemon.supervisor import run_daemon

        warn_if_no_gpu(args)
        # Bound before the model loads, so a taken port ends the daemon at once, as a taken
        # endpoint does (exit 1: cannot serve); the HTTP server processes serve this socket.
        try:
            http_socket = listen_http(*config.http_address) if config.http_address else None
        except CbatchError as err:
            release_endpoint(config.endpoint, lock_fd)
            exit_with(PROG, err.message, EXIT_FAILED)
        # It sets its own handlers first; from then on, it removes what it made.
        sys.exit(run_daemon(config, http_socket, lock_fd))
    except KeyboardInterrupt:
        if lock_fd is not None:
            release_endpoint(config.endpoint, lock_fd)
        print(f"{PROG}: stopped while starting", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def _args_and_config(argv):
    """(the flags, the daemon's configuration they make); a usage error ends the process
    with one line."""
    import logging

    from cbatch.cli.common import exit_with
    from cbatch.extras import DEFAULT_MODEL_MODULE, SERVER, SERVER_MODULES, check_extra
    from cbatch.workers.daemon.flags import config_from_args, make_parser

    args = make_parser().parse_args(argv)
    try:  # `pip install cbatch` is the client alone
        check_extra(SERVER, (*SERVER_MODULES, *(() if args.model else (DEFAULT_MODEL_MODULE,))), "the daemon")
    except CbatchError as err:
        exit_with(PROG, err.message, EXIT_USAGE)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return args, config_from_args(args)
    except CbatchError as err:  # a value the flags allow but this machine or setting does not: one line
        exit_with(PROG, err.message, EXIT_USAGE)
