"""How cbatch-submit reaches the daemon: over ZeroMQ (a cbatch Client) or over HTTP (any
OpenAI-compatible endpoint, or a cbatch daemon's batch jobs with --detach and --wait); the
flags of the two ways are checked against each other here."""

import argparse
import os
import sys

from cbatch.cli.common import exit_on_error, exit_with
from cbatch.client.batch_retry import DEFAULT_REQUEST_TIMEOUT_S
from cbatch.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, CbatchError

PROG = "cbatch-submit"


def check_transport_flags(parser: argparse.ArgumentParser, args) -> None:
    """The ZeroMQ flags and the HTTP ones name two different ways in: one at a time."""
    zeromq = [flag for flag, value in (("--endpoint", args.endpoint), ("--no-shm", args.no_shm),
                                       ("--curve-server-key", args.curve_server_key),
                                       ("--curve-client-key", args.curve_client_key)) if value]
    http = [flag for flag, value in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file),
                                     ("--model", args.model), ("--request-timeout", args.request_timeout)) if value]
    if args.url and zeromq:
        parser.error(f"--url sends over HTTP: {', '.join(zeromq)} cannot be used with it")
    if http and not args.url:
        parser.error(f"{', '.join(http)} needs --url")
    if args.url and not args.url.startswith(("http://", "https://")):
        parser.error("--url must start with http:// or https://")
    if (args.detach or args.wait) and not args.url:
        parser.error(f"{'--detach' if args.detach else '--wait'} needs --url (the daemon's --http address)")
    if (args.prompts is None) != bool(args.wait):
        parser.error("--wait takes no input file" if args.wait else "the input file is required")
    if args.detach and args.prompts == "-":
        parser.error("--detach needs a file, not standard input")
    if args.retry_for < 0:
        parser.error("--retry-for must be >= 0")
    if args.request_timeout is not None and args.request_timeout <= 0:
        parser.error("--request-timeout must be > 0")


def api_key(args) -> str | None:
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as err:
            exit_with(PROG, f"cannot read {args.api_key_file}: {err.strerror}", EXIT_USAGE)
    return args.api_key or os.environ.get("CBATCH_API_KEY") or None


def connect(args):
    """The client the file runs through: a daemon over ZeroMQ, or an HTTP endpoint."""
    if args.url:
        from cbatch.client.http_batch import HttpBatchClient

        return HttpBatchClient(args.url, api_key=api_key(args), model=args.model, retry_for_s=args.retry_for,
                               request_timeout_s=args.request_timeout or DEFAULT_REQUEST_TIMEOUT_S)
    from cbatch.client import Client

    return Client(args.endpoint, use_ring=not args.no_shm, curve_server_key=args.curve_server_key,
                  curve_client_key=args.curve_client_key)


def run_job_command(args) -> int:
    """--detach (prints the job's id) or --wait (writes its lines to -o or stdout)."""
    from cbatch.cli.detach import JobsClient

    jobs = JobsClient(args.url, api_key(args))
    try:
        if args.detach:
            print(jobs.detach(args.prompts))
            return EXIT_OK
        with open(args.output, "w", encoding="utf-8") if args.output else open(sys.stdout.fileno(), "w",
                                                                               closefd=False) as out:
            return jobs.wait(args.wait, out)
    except CbatchError as err:
        exit_on_error(PROG, err)
    except OSError as err:
        exit_with(PROG, f"cannot use {err.filename}: {err.strerror}", EXIT_USAGE)
    except KeyboardInterrupt:
        exit_with(PROG, "interrupted: the job runs on in the daemon (--wait for it again)", EXIT_INTERRUPTED)
    finally:
        jobs.close()
