"""Command-line entry points: cbatch-worker (the daemon) and cbatch-submit (a client)."""

import argparse
import itertools
import json
import logging
import sys
import time
from dataclasses import dataclass, field

from cbatch import __version__, openai_batch
from cbatch.config import (DRAIN_GRACE_S, PROGRESS_INTERVAL_S, RETENTION_S, RING_CAPACITY_RECORDS, WORKER_TIMEOUT_S,
                           DaemonConfig, EngineConfig, parse_http_address)
from cbatch.errors import CbatchError, INVALID_REQUEST, UNAVAILABLE
from cbatch.params import expand_choices
from cbatch.streams import completion_from_chunks
from cbatch.wording import counted

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
SUBMIT_PROGRESS_INTERVAL_S = 0.2  # how often cbatch-submit redraws its progress line on a terminal


def worker_main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="cbatch-worker", description="Serve one GGUF model to many clients.")
    add_version(parser)
    parser.add_argument("-m", "--model", help="GGUF file (default: the embedded gemma-3-270m)")
    parser.add_argument("-np", "--parallel", type=int, default=4, help="sequences decoded together (default 4)")
    parser.add_argument("-c", "--ctx-size", type=int, default=0, help="total context for all sequences (default 4096 each)")
    parser.add_argument("-b", "--batch-size", type=int, default=512, help="tokens per decode step (default 512)")
    parser.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: all cores)")
    parser.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1,
                        help="layers to offload to a GPU (default -1: all of them on a GPU build)")
    parser.add_argument("--max-queue", type=int, default=1024, help="requests waiting beyond --parallel (default 1024)")
    parser.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=False,
                        help="one KV pool shared by all sequences, or one stream per sequence (default)")
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV of cached prompt prefixes (default on)")
    parser.add_argument("--cache-tokens", type=int, default=0,
                        help="unified pool: KV cells kept for finished requests' prefixes (default: one sequence's context)")
    parser.add_argument("--backend-sampling", action=argparse.BooleanOptionalAction, default=None,
                        help="sample inside llama.cpp's graph when a request allows (default: on a GPU build only)")
    parser.add_argument("--endpoint", default="", help="ipc://PATH or tcp://HOST:PORT (default: CBATCH_ENDPOINT or an ipc socket)")
    parser.add_argument("--ring-capacity", type=int, default=RING_CAPACITY_RECORDS, help="token ring records (power of two)")
    parser.add_argument("--drain-grace", type=float, default=DRAIN_GRACE_S, help="seconds in-flight requests get on SIGTERM")
    parser.add_argument("--retention", type=float, default=RETENTION_S,
                        help="seconds a finished request's tokens stay fetchable by a reader the ring lapped (default 60)")
    parser.add_argument("--worker-timeout", type=float, default=WORKER_TIMEOUT_S,
                        help="seconds without a step before the decode worker is restarted (0 = never)")
    parser.add_argument("--progress-interval", type=float, default=PROGRESS_INTERVAL_S,
                        help="seconds between progress lines in the log while requests are in flight (default 10)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--allow-remote", action="store_true", help="allow a tcp:// endpoint beyond loopback")
    parser.add_argument("--curve-secret-key", default="", help="daemon's CurveZMQ secret certificate: require CurveZMQ")
    parser.add_argument("--curve-clients", default="", help="directory of client public certificates allowed in")
    parser.add_argument("--http", default="", metavar="[HOST:]PORT",
                        help="also serve the OpenAI-compatible HTTP API (default host 127.0.0.1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from cbatch.workers.http_process import listen_http
    from cbatch.workers.supervisor import EXIT_CANNOT_SERVE, run_daemon

    try:
        engine = EngineConfig(model_path=args.model, parallel=args.parallel, ctx_size=args.ctx_size,
                              batch_size=args.batch_size, threads=args.threads, n_gpu_layers=args.n_gpu_layers,
                              max_queue=args.max_queue, kv_unified=args.kv_unified,
                              prefix_cache=args.prefix_cache, cache_tokens=args.cache_tokens,
                              backend_sampling=args.backend_sampling)
        config = DaemonConfig(engine, endpoint=args.endpoint, ring_capacity=args.ring_capacity,
                              drain_grace_s=args.drain_grace, retention_s=args.retention, worker_timeout_s=args.worker_timeout,
                              allow_remote=args.allow_remote,
                              progress_interval_s=0.0 if args.quiet else args.progress_interval,
                              curve_secret_key=args.curve_secret_key, curve_clients_dir=args.curve_clients,
                              http_address=parse_http_address(args.http) if args.http else None)
    except CbatchError as err:
        parser.error(err.message)
    # Bound before the model loads, so a taken port ends the daemon at once, as a taken
    # endpoint does (exit 1: cannot serve); the HTTP server processes serve this socket.
    try:
        http_socket = listen_http(*config.http_address) if config.http_address else None
    except CbatchError as err:
        print(f"cbatch-worker: {err.message}", file=sys.stderr)
        sys.exit(EXIT_CANNOT_SERVE)
    sys.exit(run_daemon(config, http_socket))


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def _read_items(lines):
    """Yield one request dict per non-blank line, or a CbatchError for a line that is not one."""
    with lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                yield number, CbatchError(INVALID_REQUEST, f"line {number} is not valid JSON: {err.msg}")
                continue
            if not isinstance(item, dict):
                yield number, CbatchError(INVALID_REQUEST, f"line {number} must be a JSON object")
                continue
            if not all(isinstance(key, str) for key in item):
                yield number, CbatchError(INVALID_REQUEST, f"line {number} has non-string keys")
                continue
            item.setdefault("id", number)
            yield number, item


def submit_main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="cbatch-submit", description="Run a JSONL file of prompts through cbatch-worker.")
    parser.add_argument("prompts", help="JSONL: one {\"id\", \"prompt\" or \"messages\", params...} per line; - reads stdin")
    parser.add_argument("-o", "--output", help="results JSONL (default: stdout)")
    parser.add_argument("--endpoint", default=None, help="daemon endpoint (default: CBATCH_ENDPOINT or the local ipc socket)")
    parser.add_argument("--max-in-flight", type=int, default=64, help="requests outstanding at once (default 64)")
    parser.add_argument("--no-shm", action="store_true", help="take tokens over ZeroMQ instead of shared memory")
    parser.add_argument("--curve-server-key", help="the daemon's CurveZMQ public certificate (or CBATCH_CURVE_SERVER_KEY)")
    parser.add_argument("--curve-client-key", help="this client's CurveZMQ secret certificate (or CBATCH_CURVE_CLIENT_KEY)")
    parser.add_argument("--resume", action="store_true", help="skip the lines whose ids the output already holds, append the rest")
    add_version(parser)
    args = parser.parse_args(argv)
    if args.max_in_flight < 1:
        parser.error("--max-in-flight must be >= 1")
    if args.resume and not args.output:
        parser.error("--resume needs -o/--output")
    if args.prompts == "-":  # read as it comes: the number of lines is not known ahead
        num_lines, lines = None, open(sys.stdin.fileno(), encoding="utf-8", errors="strict", closefd=False)
    else:
        try:
            with open(args.prompts, encoding="utf-8") as f:
                num_lines = sum(1 for line in f if line.strip())
            lines = open(args.prompts, encoding="utf-8", errors="strict")
        except OSError as err:
            print(f"cbatch-submit: cannot read {args.prompts}: {err.strerror}", file=sys.stderr)
            sys.exit(EXIT_USAGE)
        except UnicodeDecodeError as err:
            print(f"cbatch-submit: {args.prompts} is not UTF-8 text (byte {err.start})", file=sys.stderr)
            sys.exit(EXIT_USAGE)

    from cbatch.client import Client

    try:
        done_ids = openai_batch.prepare_resume(args.output) if args.resume else set()
        out = open(args.output, "a" if args.resume else "w", encoding="utf-8") if args.output else sys.stdout
    except OSError as err:
        print(f"cbatch-submit: cannot write {args.output}: {err.strerror}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    try:
        client = Client(args.endpoint, use_ring=not args.no_shm, curve_server_key=args.curve_server_key,
                        curve_client_key=args.curve_client_key)
    except CbatchError as err:
        print(f"cbatch-submit: {err.message}", file=sys.stderr)
        sys.exit(EXIT_UNREACHABLE if err.code == UNAVAILABLE else EXIT_SOME_FAILED)
    try:
        numbered_items = _read_items(lines)
        first = []  # the lines up to the first JSON object, which tells the kind of file
        for numbered_item in numbered_items:
            first.append(numbered_item)
            if isinstance(numbered_item[1], dict):
                break
        numbered_items = itertools.chain(first, numbered_items)
        items = ((n, item) for n, item in numbered_items
                 if not (isinstance(item, dict) and openai_batch.id_key(item) in done_ids))
        if openai_batch.is_openai_batch(first):
            summary = openai_batch.run_openai_batch(client, items, out, args.max_in_flight)
        else:
            summary = _run_file(client, items, None if num_lines is None else num_lines - len(done_ids), out,
                                args.max_in_flight)
    except CbatchError as err:
        print(f"cbatch-submit: {err.message}", file=sys.stderr)
        sys.exit(EXIT_UNREACHABLE if err.code == UNAVAILABLE else EXIT_SOME_FAILED)
    except UnicodeDecodeError as err:  # standard input, read as it comes (a file was checked first)
        print(f"cbatch-submit: standard input is not UTF-8 text (byte {err.start} of a read)", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    finally:
        client.close()
        if out is not sys.stdout:
            out.close()
    print(summary["line"], file=sys.stderr)
    sys.exit(EXIT_SOME_FAILED if summary["num_failed"] else EXIT_OK)


@dataclass
class _Line:
    """One input line's results as they complete: one per choice (several with `n`)."""

    id: object
    num_choices: int
    has_n: bool
    chunks: dict = field(default_factory=dict)  # choice -> chunks so far
    results: dict = field(default_factory=dict)  # choice -> Completion | CbatchError

    def output(self) -> dict:
        errors = [r for r in self.results.values() if isinstance(r, CbatchError)]
        if errors:
            return {"id": self.id, "error": errors[0].to_dict()}
        choices = [self.results[i] for i in range(self.num_choices)]
        if not self.has_n:
            c = choices[0]
            return {"id": self.id, "text": c.text, "finish_reason": c.finish_reason, "usage": c.usage}
        usage = {"prompt_tokens": choices[0].usage["prompt_tokens"],
                 "completion_tokens": sum(c.usage["completion_tokens"] for c in choices)}
        return {"id": self.id, "usage": usage, "choices": [
            {"index": i, "text": c.text, "finish_reason": c.finish_reason, "usage": c.usage} for i, c in enumerate(choices)]}


def _run_file(client, numbered_items, num_lines: int | None, out, max_in_flight: int) -> dict:
    """Stream every item (each choice of it, with `n`) through the daemon; write one
    result line per input line, in input order."""
    show_progress = sys.stderr.isatty()
    lines: list[_Line] = []
    owners: list[tuple[int, int]] = []  # batch position -> (line, choice)
    done: dict[int, dict] = {}
    next_to_write = num_failed = num_tokens = 0
    started = shown_at = time.monotonic()

    def items():
        for number, item in numbered_items:
            try:
                bodies = [item] if isinstance(item, CbatchError) else expand_choices(item)
            except CbatchError as err:
                bodies = [err]
            has_n = isinstance(item, dict) and "n" in item
            lines.append(_Line(item.get("id") if isinstance(item, dict) else number, len(bodies), has_n))
            for choice, body in enumerate(bodies):
                owners.append((len(lines) - 1, choice))
                yield body

    for position, chunk in client.stream_batch(items(), max_in_flight):
        line_index, choice = owners[position]
        line = lines[line_index]
        if isinstance(chunk, CbatchError):
            line.results[choice] = chunk
        else:
            line.chunks.setdefault(choice, []).append(chunk)
            num_tokens += len(chunk.token_ids)
            if chunk.finish_reason:
                line.results[choice] = completion_from_chunks(line.chunks.pop(choice))
        if len(line.results) == line.num_choices:
            done[line_index] = line.output()
            num_failed += "error" in done[line_index]
        while next_to_write in done:
            out.write(json.dumps(done.pop(next_to_write), ensure_ascii=False) + "\n")
            lines[next_to_write] = None  # written: keep no more of it
            next_to_write += 1
        if show_progress and time.monotonic() - shown_at >= SUBMIT_PROGRESS_INTERVAL_S:
            shown_at = time.monotonic()
            elapsed = max(shown_at - started, 1e-9)
            total = "" if num_lines is None else f"/{num_lines}"
            print(f"\r{next_to_write + len(done)}{total} done, {num_tokens / elapsed:.1f} tok/s", end="",
                  file=sys.stderr)
    out.flush()
    elapsed = time.monotonic() - started
    if show_progress:
        print(file=sys.stderr)
    num_done = next_to_write
    return {"num_failed": num_failed, "line": (
        f"cbatch-submit: {counted(num_done, 'line')}, {num_done - num_failed} ok, {num_failed} failed; "
        f"{counted(num_tokens, 'token')} in {elapsed:.1f} s ({num_tokens / max(elapsed, 1e-9):.1f} tok/s)")}
