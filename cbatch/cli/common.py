"""What the console scripts share: --version, one-line failures and their exit codes."""

import argparse
import sys
from typing import NoReturn

from cbatch import __version__
from cbatch.errors import EXIT_FAILED, EXIT_UNREACHABLE, UNAVAILABLE, CbatchError


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """How a command-line client finds and authenticates to a daemon."""
    parser.add_argument("--endpoint", default=None,
                        help="daemon endpoint (default: CBATCH_ENDPOINT or the local ipc socket)")
    parser.add_argument("--curve-server-key",
                        help="the daemon's CurveZMQ public certificate (or CBATCH_CURVE_SERVER_KEY)")
    parser.add_argument("--curve-client-key",
                        help="this client's CurveZMQ secret certificate (or CBATCH_CURVE_CLIENT_KEY)")


def exit_with(prog: str, message: str, code: int) -> NoReturn:
    print(f"{prog}: {message}", file=sys.stderr)
    sys.exit(code)


def exit_on_error(prog: str, err: CbatchError) -> NoReturn:
    """A daemon that did not answer exits EXIT_UNREACHABLE, any other error EXIT_FAILED."""
    exit_with(prog, err.message, EXIT_UNREACHABLE if err.code == UNAVAILABLE else EXIT_FAILED)
