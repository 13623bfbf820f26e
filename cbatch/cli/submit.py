"""cbatch-submit: run a JSONL file of requests (cbatch's own or an OpenAI batch file)
through a daemon and write one result line per input line, in input order."""

import argparse
import dataclasses
import functools
import itertools
import signal
import sys
import time
from collections.abc import Callable

from cbatch.batch.batch_run import BatchInterrupted, EmbeddingTally, InOrderWriter, RunSummary, run_batch
from cbatch.batch.input_lines import read_items
from cbatch.batch.line_keys import LineSelector, native_id, openai_id
from cbatch.batch.native_batch import NativeLine
from cbatch.batch.openai_batch import OpenAILine, is_openai_batch
from cbatch.batch.resume import prepare_resume
from cbatch.cli.common import add_client_flags, add_version, exit_on_error, exit_with
from cbatch.cli.submit_transport import PROG, check_transport_flags, connect, run_job_command
from cbatch.client.batch_feeder import DEFAULT_MAX_IN_FLIGHT
from cbatch.client.batch_retry import DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_RETRY_FOR_S, Patience, call_held
from cbatch.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, CbatchError
from cbatch.extras import URL, URL_MODULES, check_extra
from cbatch.wording import counted

READY_POLL_S = 0.2  # while the daemon's model loads, before an OpenAI batch file's lines are read


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Run a JSONL file of prompts through cbatch-worker.")
    parser.add_argument("prompts", nargs="?",
                        help="JSONL: one {\"id\", \"prompt\" or \"messages\", params...} per line; - reads stdin")
    parser.add_argument("-o", "--output", help="results JSONL (default: stdout)")
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT,
                        help=f"requests outstanding at once (default {DEFAULT_MAX_IN_FLIGHT})")
    parser.add_argument("--no-shm", action="store_true", help="take tokens over ZeroMQ instead of shared memory")
    parser.add_argument("--resume", action="store_true",
                        help="skip the lines the output already answers, append the rest (lines an older "
                             "run wrote as a transient error are removed and run again)")
    parser.add_argument("--retry-for", type=float, default=DEFAULT_RETRY_FOR_S, metavar="SECONDS",
                        help="hold and send again the lines a draining, restarting, full or unreachable daemon "
                             "refused, until nothing has been answered for this long; then stop "
                             f"(default {DEFAULT_RETRY_FOR_S:.0f})")
    add_client_flags(parser)
    http = parser.add_argument_group("over HTTP, to any OpenAI-compatible endpoint (a router, a daemon's --http)")
    http.add_argument("--url", help="send the requests to this OpenAI base URL, e.g. http://127.0.0.1:30000/v1, "
                                    "instead of a daemon's ZeroMQ endpoint")
    key = http.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="sent as Authorization: Bearer KEY (or CBATCH_API_KEY)")
    key.add_argument("--api-key-file", help="a file holding the key (kept out of the process list)")
    http.add_argument("--model", help="the model to ask for (default: the first GET /v1/models lists)")
    http.add_argument("--request-timeout", type=float, metavar="SECONDS",
                      help="the longest one try of a request may take before it is sent again "
                           f"(default {DEFAULT_REQUEST_TIMEOUT_S:.0f})")
    jobs = http.add_mutually_exclusive_group()
    jobs.add_argument("--detach", action="store_true",
                      help="hand the OpenAI batch file to the daemon at --url as a batch job and print its id")
    jobs.add_argument("--wait", metavar="BATCH_ID", help="wait for a batch job to end and write its result lines")
    add_version(parser)
    return parser


def open_input(path: str):
    """(number of lines or None for stdin, the open text stream); exits EXIT_USAGE if unreadable."""
    if path == "-":  # read as it comes: the number of lines is not known ahead
        return None, open(sys.stdin.fileno(), encoding="utf-8-sig", errors="strict", closefd=False)
    try:  # utf-8-sig: a byte-order mark (some editors write one) is not part of the first line
        with open(path, encoding="utf-8-sig") as f:
            num_lines = sum(1 for line in f if line.strip())
        return num_lines, open(path, encoding="utf-8-sig", errors="strict")
    except OSError as err:
        exit_with(PROG, f"cannot read {path}: {err.strerror}", EXIT_USAGE)
    except UnicodeDecodeError as err:
        exit_with(PROG, f"{path} is not UTF-8 text (byte {err.start})", EXIT_USAGE)


def open_output(path: str | None, resume: bool) -> tuple[set[str], int, object]:
    """(the keys of the input lines already answered, the number of lines the output then
    holds, the output stream); exits EXIT_USAGE if unwritable."""
    if not path:
        return set(), 0, sys.stdout
    try:
        done_keys, num_kept_lines = prepare_resume(path) if resume else (set(), 0)
        return done_keys, num_kept_lines, open(path, "a" if resume else "w", encoding="utf-8")
    except OSError as err:
        exit_with(PROG, f"cannot write {path}: {err.strerror}", EXIT_USAGE)


def run_file(client, numbered_items, done_keys: set[str], num_lines: int | None, out,
             max_in_flight: int, retry_for_s: float) -> tuple[RunSummary, str]:
    """Tell the kind of file by its first JSON object, skip lines already done (the
    summary counts them), refuse a line that repeats an earlier one's id, run the rest.
    The requests a daemon refuses for a moment are held and sent again for up to
    retry_for_s with nothing answered: over HTTP by the client itself, over ZeroMQ by the
    batch (and the embeddings lines' calls) with one patience."""
    first = []  # the lines up to the first JSON object
    for numbered_item in numbered_items:
        first.append(numbered_item)
        if isinstance(numbered_item[1], dict):
            break
    is_openai = is_openai_batch(first)
    selector = LineSelector(done_keys, openai_id if is_openai else native_id)
    items = selector.select(itertools.chain(first, numbered_items))
    num_left = None if num_lines is None else max(num_lines - len(done_keys), 0)
    is_http = hasattr(client, "model_names")
    if is_http:
        stream_batch, embed = client.stream_batch, client.embeddings
    else:
        patience = Patience(retry_for_s)
        stream_batch = functools.partial(client.stream_batch, patience=patience)
        embed = functools.partial(_held_embeddings, client, patience)
    embed = EmbeddingTally(embed)
    make_line, noun = _line_maker(client, is_openai, is_http, embed)
    summary = run_batch(stream_batch, items, make_line, InOrderWriter(out), max_in_flight, num_left)
    return dataclasses.replace(summary, num_skipped=selector.num_skipped, num_embedded=embed.num_inputs,
                               num_embedding_tokens=embed.num_prompt_tokens), noun


def _line_maker(client, is_openai: bool, is_http: bool, embed: EmbeddingTally) -> tuple[Callable, str]:
    """(what makes a batch line of an input line, the summary's noun for one)."""
    if not is_openai:  # over HTTP a line is checked here as the daemon would: a server may ignore what it does not know
        return functools.partial(NativeLine, checks_bodies=is_http), "line"
    # `model` follows the HTTP API's rule: a name the daemon serves. An HTTP endpoint's
    # names (and a cbatch one's thinking tags) are in its /v1/models listing, and it takes
    # tools itself; a daemon's are in its health reply, and tools are prepared here for
    # the call format its handshake names, as its HTTP server prepares them.
    if is_http:
        model_names, reasoning = client.model_names, client.reasoning
    else:
        health = _ready_health(client)
        model_names, reasoning = health["model_names"], health.get("reasoning")
    return functools.partial(OpenAILine, model_names=model_names, embed=embed,
                             tool_format=None if is_http else client.tool_format, reasoning=reasoning,
                             forwards_tools=is_http), "OpenAI batch line"


def _held_embeddings(client, patience: Patience, inputs, dimensions=None):
    """client.embeddings, held through a drain or a restart as the lines' requests are
    (each try is a message the daemon, or one restarted on the endpoint, answers)."""
    return call_held(lambda: client.embeddings(inputs, dimensions), patience, client.pause)


def _ready_health(client) -> dict:
    """The daemon's health once its model is loaded: its model names and thinking tags,
    which OpenAI lines are checked and split by as the HTTP server does, come with it."""
    is_told = False
    while (health := client.health())["status"] == "starting":
        if not is_told:
            print(f"{PROG}: waiting for the daemon to load its model", file=sys.stderr, flush=True)
            is_told = True
        time.sleep(READY_POLL_S)
    return health


def interrupted_line(summary: RunSummary, num_kept_lines: int, num_lines: int | None, output: str | None) -> str:
    """What the output holds: the lines an earlier run left, and this run's."""
    num_written = num_kept_lines + summary.num_written
    of_total = "" if num_lines is None else f" of {num_lines}"
    where = f" to {output}; rerun with --resume" if output else ""
    return f"interrupted: {num_written}{of_total} lines written{where}"


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> None:
    # SIGTERM (a service manager, `kill`) stops a run as Ctrl-C does: what is written is kept.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    args = _checked_args(argv)
    if args.detach or args.wait:
        sys.exit(run_job_command(args))
    num_lines, lines = open_input(args.prompts)
    try:  # first: the output of an earlier run is not emptied when no daemon answers
        client = connect(args)
    except CbatchError as err:
        exit_on_error(PROG, err)
    try:
        done_keys, num_kept_lines, out = open_output(args.output, args.resume)
    except BaseException:
        client.close()
        raise
    try:
        summary, noun = run_file(client, read_items(lines), done_keys, num_lines, out, args.max_in_flight,
                                 args.retry_for)
    except CbatchError as err:
        exit_on_error(PROG, err)
    except BatchInterrupted as interrupted:
        line = interrupted_line(interrupted.summary, num_kept_lines, num_lines, args.output)
        if interrupted.reason is None:
            exit_with(PROG, line, EXIT_INTERRUPTED)
        exit_with(PROG, f"{line} (nothing answered for {args.retry_for:g} s, --retry-for: "
                        f"{interrupted.reason.message})", EXIT_UNREACHABLE)
    except KeyboardInterrupt:
        exit_with(PROG, "interrupted", EXIT_INTERRUPTED)
    except UnicodeDecodeError as err:  # standard input, read as it comes (a file was checked first)
        exit_with(PROG, f"standard input is not UTF-8 text (byte {err.start} of a read)", EXIT_USAGE)
    finally:
        client.close()
        if out is not sys.stdout:
            out.close()
    print(summary.line(noun, is_resumed=args.resume), file=sys.stderr)
    if args.resume and num_kept_lines > summary.num_skipped:  # the output was another input's, or edited
        print(f"{PROG}: {args.output} also holds {counted(num_kept_lines - summary.num_skipped, 'line')} "
              "of an earlier run answering no line of this input", file=sys.stderr)
    sys.exit(EXIT_FAILED if summary.num_failed else EXIT_OK)


def _checked_args(argv):
    """The flags, with what the parser cannot check itself checked (a usage error ends here)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.max_in_flight < 1:
        parser.error("--max-in-flight must be >= 1")
    if args.resume and not args.output:
        parser.error("--resume needs -o/--output")
    check_transport_flags(parser, args)
    if args.url:
        try:
            check_extra(URL, URL_MODULES, f"{PROG} --url")
        except CbatchError as err:
            exit_with(PROG, err.message, EXIT_USAGE)
    return args
