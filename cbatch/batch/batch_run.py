"""Runs a batch file through the daemon: every line's requests (one per choice) go out
with at most `max_in_flight` outstanding, and one result line per input line is written
by the run's writer: cbatch-submit's InOrderWriter writes them in input order, flushed as
it writes, so an interrupted run keeps what it finished (`--resume` continues from
there); a batch job's results log (cbatch.jobs.results) writes each as soon as it
finishes. The kinds of file differ only in their line class."""

import json
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from cbatch.client.batch_feeder import Choices
from cbatch.client.batch_retry import is_transient
from cbatch.errors import CbatchError
from cbatch.wording import counted

PROGRESS_INTERVAL_S = 0.2  # how often the progress line is redrawn on a terminal


class BatchLine(Protocol):
    """One input line: the requests it sends and its result once all of them ended."""

    bodies: list[dict]  # one request per choice; empty for a line that cannot run
    result: dict | None  # the output line, None until every choice ended (or the line failed)

    @property
    def is_ok(self) -> bool: ...

    def add(self, choice: int, chunk_or_error) -> None: ...


@dataclass
class RunSummary:
    num_written: int  # lines this run wrote, failed ones included
    num_failed: int
    num_tokens: int
    elapsed_s: float
    num_skipped: int = 0  # input lines an earlier run had answered (--resume)
    num_embedded: int = 0  # inputs of embeddings lines
    num_embedding_tokens: int = 0  # their prompt tokens (0 from a server that does not say)

    def line(self, noun: str, is_resumed: bool = False) -> str:
        """What the run did: the tokens generated and the inputs embedded, whichever it did
        (a file of embeddings lines generates nothing, and its rate would say 0 tok/s)."""
        skipped = f", {self.num_skipped} skipped as done by an earlier run" if is_resumed else ""
        is_generating = self.num_tokens or not self.num_embedded
        done = [counted(self.num_tokens, "token")] if is_generating else []
        if self.num_embedded:
            tokens = f" ({counted(self.num_embedding_tokens, 'prompt token')})" if self.num_embedding_tokens else ""
            done.append(f"{counted(self.num_embedded, 'input')} embedded{tokens}")
        rate = f" ({self.num_tokens / max(self.elapsed_s, 1e-9):.1f} tok/s)" if is_generating else ""
        return (f"cbatch-submit: {counted(self.num_written, noun)} written, {self.num_written - self.num_failed} ok, "
                f"{self.num_failed} failed{skipped}; {' and '.join(done)} in {self.elapsed_s:.1f} s{rate}")


class EmbeddingTally:
    """Counts what an embeddings call (`embed(inputs, dimensions)`, a client's) did, for
    the run's summary."""

    def __init__(self, embed):
        self._embed = embed
        self.num_inputs = self.num_prompt_tokens = 0

    def __call__(self, inputs, dimensions=None):
        result = self._embed(inputs, dimensions)
        self.num_inputs += len(result.data)
        self.num_prompt_tokens += result.prompt_tokens
        return result


class BatchInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped the run, or the daemon refused or went away for longer than
    the run's patience (`reason`: the last transient error); `summary` says what was
    written before."""

    def __init__(self, summary: RunSummary, reason: CbatchError | None = None):
        super().__init__("interrupted")
        self.summary, self.reason = summary, reason


class InOrderWriter:
    """Writes finished lines to `out` in input order, keeping nothing of a written line:
    what it holds is the lines from the first unwritten one on, O(max_in_flight)."""

    def __init__(self, out):
        self.out = out
        self.lines: dict[int, BatchLine] = {}  # line index -> line, for the lines not yet written
        self.num_lines = self.num_written = self.num_failed = 0

    def append(self, line: BatchLine) -> int:
        self.lines[self.num_lines] = line
        self.num_lines += 1
        return self.num_lines - 1

    def write_ready(self) -> None:
        num_before = self.num_written
        while self.num_written < self.num_lines and self.lines[self.num_written].result is not None:
            line = self.lines.pop(self.num_written)
            self.num_failed += not line.is_ok
            self.out.write(json.dumps(line.result, ensure_ascii=False) + "\n")
            self.num_written += 1
        if self.num_written > num_before:
            self.out.flush()  # what is written survives an interruption, for --resume

    @property
    def num_done(self) -> int:
        """Written, or finished and waiting for an earlier line."""
        return self.num_written + sum(1 for line in self.lines.values() if line.result is not None)


def run_batch(stream_batch, numbered_items: Iterable, make_line: Callable[[int, object], BatchLine], writer,
              max_in_flight: int, num_lines: int | None = None, is_progress_drawn: bool = True,
              should_stop: Callable[[], bool] | None = None) -> RunSummary:
    """`writer` keeps the unfinished lines (`append`, `lines`) and writes the finished ones
    (`write_ready`). `stream_batch(items, max_in_flight)` is the client's, which holds and sends again
    the requests refused for a moment (batch_retry); `numbered_items` yields (line number,
    dict or CbatchError); `num_lines`, when known, is shown in the progress line (drawn
    only when stderr is a terminal and is_progress_drawn). A KeyboardInterrupt ends the run with
    BatchInterrupted: what was written stays written, and the requests still outstanding
    are cancelled. So does a transient error, which arrives only once the client's
    patience is spent: a transient error is never a result, so its line is not written
    and --resume runs it, and no more lines are read (an endless input would otherwise
    turn into endless errors). A run that should_stop() ends early (a batch job's cancel or
    window, a drain) ends as a KeyboardInterrupt does, between two arrivals: the stream
    stops (`stream_batch(items, max_in_flight, should_stop=...)`) and the run raises
    BatchInterrupted unless every line was answered."""
    run = _Arrivals(writer, make_line, num_lines, is_progress_drawn and sys.stderr.isatty())
    items = run.batch_items(numbered_items)
    arrivals = (stream_batch(items, max_in_flight) if should_stop is None
                else stream_batch(items, max_in_flight, should_stop=should_stop))
    try:
        for position, chunk in arrivals:
            run.take(position, chunk)
        writer.write_ready()  # lines that sent no request (bad lines at the end)
        if not run.is_input_read or run.owners:  # the stream stopped early: should_stop() held
            raise BatchInterrupted(run.summary())
    except KeyboardInterrupt:
        arrivals.close()  # cancels the outstanding requests
        raise BatchInterrupted(run.summary()) from None
    except CbatchError as err:  # a request's, or an embeddings line's (raised as the line was read)
        if not is_transient(err):
            raise
        arrivals.close()
        writer.write_ready()
        raise BatchInterrupted(run.summary(), err) from None
    finally:
        if run.show_progress:
            print(file=sys.stderr)
    return run.summary()


class _Arrivals:
    """One run's lines as batch items, and what arrives for them: each chunk to the line
    (and choice) that owns its batch position, the finished lines written in order."""

    def __init__(self, writer, make_line: Callable[[int, object], BatchLine], num_lines: int | None,
                 show_progress: bool):
        self.writer, self.make_line, self.num_lines, self.show_progress = writer, make_line, num_lines, show_progress
        self.owners: dict[int, tuple[int, int]] = {}  # batch position still outstanding -> (line index, choice)
        self.num_positions = 0
        self.num_tokens = 0
        self.is_input_read = False
        self.started_s = self.shown_s = time.monotonic()

    def batch_items(self, numbered_items: Iterable):
        """One batch item per line that runs: its request, or its choices, which end
        together (the first to fail cancels the others)."""
        for number, item in numbered_items:
            line_index = self.writer.append(self.make_line(number, item))
            bodies = self.writer.lines[line_index].bodies
            self.owners.update((self.num_positions + choice, (line_index, choice)) for choice in range(len(bodies)))
            self.num_positions += len(bodies)
            if len(bodies) == 1:
                yield bodies[0]
            elif bodies:
                yield Choices(bodies)
        self.is_input_read = True

    def take(self, position: int, chunk) -> None:
        """A chunk or an error for a batch position; a transient error is raised (never a result)."""
        is_error = isinstance(chunk, CbatchError)
        if is_error and is_transient(chunk):
            raise chunk
        owner = self.owners.pop(position, None) if is_error or chunk.finish_reason else self.owners.get(position)
        line = None if owner is None else self.writer.lines.get(owner[0])
        if line is not None:  # None: already written (its first failure ended it): a sibling's late chunk
            line.add(owner[1], chunk)
        if not is_error and chunk.finish_reason:
            self.num_tokens += chunk.usage["completion_tokens"]  # an HTTP answer has text but no token ids
        self.writer.write_ready()
        if self.show_progress and time.monotonic() - self.shown_s >= PROGRESS_INTERVAL_S:
            self.shown_s = time.monotonic()
            total = "" if self.num_lines is None else f"/{self.num_lines}"
            rate = self.num_tokens / max(self.shown_s - self.started_s, 1e-9)
            print(f"\r{self.writer.num_done}{total} done, {rate:.1f} tok/s", end="", file=sys.stderr)

    def summary(self) -> RunSummary:
        return RunSummary(self.writer.num_written, self.writer.num_failed, self.num_tokens,
                          time.monotonic() - self.started_s)
