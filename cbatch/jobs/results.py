"""A job's results log and the output and error files made from it.

The log (`batches/<id>.results.jsonl`) holds one OpenAI batch output line per finished
input line, in the order they finished, each appended as it finishes. Lines are made
durable by group commit: one fsync for the lines that finished within GROUP_COMMIT_S of
each other (an fsync per line held the run to a few hundred lines a second), and a line
counts as done (request_counts, progress) only once its fsync returned. After a crash the
log holds every line counted (a last line cut by the crash is dropped; lines written but
not yet synced may be there or not, and are not counted twice either way), so a
restarted runner sends only the others and none twice. A line of the log that is not a
whole result (cut by a crash, or damaged on disk) is dropped when the log is read back,
and the log rewritten without it: that input line runs again, and no later read of the
job fails on it. A write the disk cannot take whole (full) is undone, and the job waits
for room (cbatch.jobs.job_runner), its finished lines kept. When the job ends
the log is read back in input order into the output file (the lines answered 200) and
the error file (the rest); the input is streamed and the log read by offset, so memory
holds one key and offset per finished line, not the lines.
"""

import json
import os
import time

from cbatch.batch.input_lines import read_items
from cbatch.batch.line_keys import LineSelector, id_key, line_key, openai_id, result_key
from cbatch.errors import INVALID_REQUEST, CbatchError
from cbatch.jobs.progress import usage_tokens

GROUP_COMMIT_S = 0.05  # the longest a finished line waits for its fsync while more lines run


def is_ok(result: dict) -> bool:
    return result["error"] is None and result["response"]["status_code"] == 200


def input_lines(path: str, endpoint: str, done_keys: set[str] = frozenset()):
    """(line number, item, key) for each input line of a job not in done_keys, as
    cbatch-submit reads an OpenAI batch file; a line for another endpoint than the job's
    is refused (and known by its line number, as any line that is not a request)."""
    def checked():
        # "\n" alone ends a line, as the upload counted them (cbatch.jobs.files): a file of
        # lines joined by "\r" is one long line, an error that costs only itself.
        for number, item in read_items(open(path, encoding="utf-8-sig", newline="\n")):
            if isinstance(item, dict) and item.get("url") != endpoint:
                item = CbatchError(INVALID_REQUEST, f"line {number}: url {item.get('url')!r} is not the batch's "
                                                    f"endpoint {endpoint}")
            yield number, item

    selector = LineSelector(done_keys, openai_id)
    for number, item in selector.select(checked()):
        yield number, item, line_key(number) if isinstance(item, CbatchError) else id_key(item["custom_id"])


class ResultsLog:
    """The writer cbatch.batch.batch_run takes, writing each line as soon as it finishes;
    `on_written()` is called after each group of lines made durable (and counted)."""

    def __init__(self, path: str, on_written=lambda: None):
        self.path, self.on_written = path, on_written
        self.done_keys: set[str] = set()
        self.total_completed = self.total_failed = 0  # in the log, this run's lines included
        self.total_prompt_tokens = self.total_generated_tokens = 0  # ... and their usage's
        self._read_back()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.lines: dict = {}  # index -> line, the unfinished lines of this run
        self.num_lines = self.num_written = self.num_failed = 0  # this run's, durable
        self._unsynced: list[dict] = []  # written, waiting for the group's fsync
        self._synced_s = 0.0

    def _read_back(self) -> None:
        """Count the log's results; a line that is not one is dropped (rewrite_without)."""
        if not os.path.exists(self.path):
            return
        num_bad = 0
        with open(self.path, "rb") as log:
            for line in log:
                result = parsed_result(line)
                if result is None:
                    num_bad += 1
                else:
                    self._count(result)
        if num_bad:
            rewrite_without_bad_lines(self.path)

    def _count(self, result: dict) -> None:
        self.done_keys.add(result_key(result))
        prompt_tokens, generated_tokens = usage_tokens(result)
        self.total_prompt_tokens += prompt_tokens
        self.total_generated_tokens += generated_tokens
        if is_ok(result):
            self.total_completed += 1
        else:
            self.total_failed += 1

    def append(self, line) -> int:
        self.lines[self.num_lines] = line
        self.num_lines += 1
        return self.num_lines - 1

    def write_ready(self) -> None:
        """Write the finished lines; sync them once the group's time is up, or at once when
        no line runs any more (no later finish would sync them)."""
        for index in [index for index, line in self.lines.items() if line.result is not None]:
            result = self.lines.pop(index).result
            self._write_whole((json.dumps(result, ensure_ascii=False) + "\n").encode())
            self._unsynced.append(result)
        if self._unsynced and (not self.lines or time.monotonic() - self._synced_s >= GROUP_COMMIT_S):
            self.sync()

    def _write_whole(self, data: bytes) -> None:
        """Append one line whole, or leave the log as it was and raise the OSError (a full disk)."""
        start = os.lseek(self._fd, 0, os.SEEK_END)
        written = 0
        try:
            while written < len(data):
                num_bytes = os.write(self._fd, data[written:])
                if num_bytes == 0:
                    raise OSError("the disk took no more bytes")
                written += num_bytes
        except OSError:
            os.ftruncate(self._fd, start)  # no part of a line is left for a later read to trip on
            raise

    def sync(self) -> None:
        """Make the written lines durable, then count them done."""
        if not self._unsynced:
            return
        os.fsync(self._fd)
        self._synced_s = time.monotonic()
        for result in self._unsynced:
            self._count(result)
            self.num_written += 1
            self.num_failed += not is_ok(result)
        self._unsynced.clear()
        self.on_written()

    @property
    def num_done(self) -> int:
        return self.num_written

    def close(self) -> None:
        self.sync()
        os.close(self._fd)


def parsed_result(line: bytes) -> dict | None:
    """A log line's result, or None for a line that is not a whole one."""
    if not line.endswith(b"\n"):
        return None
    try:
        result = json.loads(line)
        result_key(result), is_ok(result)  # what every reader of the log looks up
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return result if isinstance(result, dict) else None


def rewrite_without_bad_lines(path: str) -> None:
    """The log without its lines that are not whole results, written whole and renamed over it."""
    temporary = f"{path}.tmp"
    with open(path, "rb") as log, open(temporary, "wb") as kept:
        for line in log:
            if parsed_result(line) is not None:
                kept.write(line)
        kept.flush()
        os.fsync(kept.fileno())
    os.replace(temporary, path)


def write_outputs(log_path: str, input_path: str, endpoint: str, output, errors, unanswered=None) -> None:
    """Each input line's result, in input order, to `output` (answered 200) or `errors`
    (binary streams). A line the log does not answer is left out, or, with `unanswered`
    (a function of the line's custom_id giving its result), written to `errors` as that."""
    offsets: dict[str, int] = {}
    with open(log_path, "rb") as log:
        offset = 0
        for line in log:
            offsets[result_key(json.loads(line))] = offset
            offset += len(line)
        for number, item, key in input_lines(input_path, endpoint):
            if key not in offsets:
                if unanswered is not None:
                    custom_id = item.get("custom_id") if isinstance(item, dict) else None
                    errors.write((json.dumps(unanswered(custom_id), ensure_ascii=False) + "\n").encode())
                continue
            log.seek(offsets[key])
            line = log.readline()
            (output if is_ok(json.loads(line)) else errors).write(line)
