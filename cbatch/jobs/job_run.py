"""One batch job, run by the job runner: validating -> in_progress -> finalizing -> completed,
or ended by its cancel (cancelled) or its completion window (expired).

The lines run as cbatch-submit runs an OpenAI batch file (cbatch.batch.batch_run with its
OpenAILine, at batch priority, the same mapping as the HTTP endpoints), with two
differences: each result is made durable as it finishes (group commit: cbatch.jobs.results),
and a run may stop at any point (a cancel, the window's end, the daemon draining or
killed) and go on later from its log. Requests refused for a moment (a decode worker
restarting, a full queue, a drain) are held and sent again (batch_retry), never results.
The lines run as the tenant of the API key that created the job, whatever their bodies
say, as the live endpoints run a key's requests.
"""

import contextlib
import functools
import hashlib
import logging
import os
import tempfile
import time
import uuid

from cbatch.batch.batch_run import BatchInterrupted, run_batch
from cbatch.batch.openai_batch import OpenAILine
from cbatch.client.batch_feeder import DEFAULT_MAX_IN_FLIGHT
from cbatch.client.batch_retry import DEFAULT_RETRY_FOR_S, Patience, call_held
from cbatch.jobs.batches import (
    CANCELLED,
    COMPLETED,
    EXPIRED,
    FAILED,
    FINAL_STATUSES,
    FINALIZING,
    IN_PROGRESS,
    VALIDATING,
    BatchStore,
)
from cbatch.jobs.files import BATCH_OUTPUT, OWNER
from cbatch.jobs.progress import RunProgress
from cbatch.jobs.results import ResultsLog, input_lines, write_outputs
from cbatch.jobs.state_dir import fsync_dir
from cbatch.params import BATCH

log = logging.getLogger("cbatch.jobs")

PROGRESS_SAVE_S = 0.5  # how often request_counts and progress are written while a job runs
STOP_CHECK_S = 0.1  # how often a running job looks for its cancel marker and its window's end
EXPIRED_ERROR = {"code": "batch_expired",
                 "message": "This request could not be executed before the completion window expired."}


def output_file_id(batch_id: str, kind: str) -> str:
    """A job's output or error file id, the same each time it is made: a job finalized
    again after a crash replaces its files instead of leaving others behind."""
    return "file-" + hashlib.sha256(f"{batch_id} {kind}".encode()).hexdigest()[:24]


class JobRun:
    """`client` is the job's own (a cbatch Client); `health` the daemon's, once ready (its
    model names and thinking tags); `is_runner_stopping()` says the runner drains, or wants
    the job's place for a waiting tenant's."""

    def __init__(self, store: BatchStore, batch_id: str, client=None, health: dict | None = None,
                 is_runner_stopping=lambda: False):
        self.store, self.client, self.health = store, client, health or {}
        self.is_runner_stopping = is_runner_stopping
        self.batch = store.stored(batch_id)
        self.input_path = store.input_path(batch_id)
        self._saved_s = 0.0
        self._run_progress: RunProgress | None = None  # set as the lines' run starts
        self._stop_checked_s = 0.0
        self._is_stopped = False

    def should_stop(self) -> bool:
        """The run stops between two arrivals once the runner drains, the job's cancel is
        asked or its window ends (the cancel marker is looked at every STOP_CHECK_S)."""
        if not self._is_stopped and time.monotonic() - self._stop_checked_s >= STOP_CHECK_S:
            self._stop_checked_s = time.monotonic()
            self._is_stopped = self.store.cancel_asked_at(self.batch["id"]) is not None or self.is_expired()
        return self._is_stopped or self.is_runner_stopping()

    def _save(self, **fields) -> None:
        self.batch.update(fields)
        self.store.save(self.batch)
        self._saved_s = time.monotonic()

    def is_expired(self) -> bool:
        return time.time() >= self.batch["expires_at"]

    def run(self) -> bool:
        """Run the job on from where it was; False when it stopped unfinished (the runner
        stops, or the daemon refused for longer than the patience): it goes on later."""
        batch_id = self.batch["id"]
        if self.batch["status"] in FINAL_STATUSES:  # ended meanwhile (a waiting job's cancel or window: end_waiting)
            return True
        if self.batch["status"] == FINALIZING:  # every line was answered: its window no longer matters
            return self._finish(COMPLETED)
        if self.end_waiting():  # cancelled, or out of its window, before it started: its requests counted
            return True
        if self.store.cancel_asked_at(batch_id) is not None:
            return self._finish(CANCELLED)
        if self.batch["status"] == VALIDATING:
            if not self._take_input():
                return self.fail("missing_file", f"the input file {self.batch['input_file_id']} was deleted")
            if not self.is_expired():
                self._save(status=IN_PROGRESS, in_progress_at=int(time.time()))
                log.info("cbatch jobs: %s started, %d requests", batch_id, self.batch["request_counts"]["total"])
        if self.is_expired():
            return self._finish(EXPIRED)
        if not self._run_lines():
            if self.store.cancel_asked_at(batch_id) is not None:
                return self._finish(CANCELLED)
            return self._finish(EXPIRED) if self.is_expired() else False
        return self._finish(COMPLETED)

    def end_waiting(self) -> bool:
        """End a job that never started whose cancel was asked (`cancelled`) or whose window
        is over (`expired`, with a batch_expired error line for every request), counting its
        requests. False when it is not such a job."""
        is_cancelled = self.store.cancel_asked_at(self.batch["id"]) is not None
        if self.batch["status"] != VALIDATING or not (is_cancelled or self.is_expired()):
            return False
        if not self._take_input():
            return self.fail("missing_file", f"the input file {self.batch['input_file_id']} was deleted")
        return self._finish(CANCELLED if is_cancelled else EXPIRED)

    def _take_input(self) -> bool:
        """The job's own link to its input file (the file may be deleted from the Files API
        while the job is kept), and its number of requests; False if the file is gone."""
        try:
            if not os.path.exists(self.input_path):
                os.link(self.store.files.content_path(self.batch["input_file_id"]), self.input_path)
                fsync_dir(os.path.dirname(self.input_path))
        except FileNotFoundError:
            return False
        total = sum(1 for _ in input_lines(self.input_path, self.batch["endpoint"]))
        self._save(request_counts={**self.batch["request_counts"], "total": total})
        return True

    def _run_lines(self) -> bool:
        results = ResultsLog(self.store.results_path(self.batch["id"]), lambda: self._save_progress(results))
        self._run_progress = RunProgress(results.total_completed + results.total_failed, results.total_generated_tokens)
        patience = Patience(DEFAULT_RETRY_FOR_S)
        client = self.client
        tenant = self.batch.get(OWNER)

        def embed(inputs, dimensions=None):  # the key's tenant's, as its completions are
            return call_held(lambda: client.embeddings(inputs, dimensions, tenant), patience, client.pause)

        def make_line(number, item) -> OpenAILine:
            line = OpenAILine(number, item, self.health["model_names"], embed=embed, tool_format=client.tool_format,
                              reasoning=self.health.get("reasoning"), priority=BATCH)
            if tenant is not None:
                line.bodies = [{**body, "tenant": tenant} for body in line.bodies]
            return line

        items = ((number, item) for number, item, _key in
                 input_lines(self.input_path, self.batch["endpoint"], results.done_keys))
        try:
            run_batch(functools.partial(client.stream_batch, patience=patience), items, make_line, results,
                      max(DEFAULT_MAX_IN_FLIGHT, self.health["parallel"]), is_progress_drawn=False,
                      should_stop=self.should_stop)
        except BatchInterrupted as interrupted:
            if interrupted.reason is not None:
                log.warning("cbatch jobs: %s paused: %s", self.batch["id"], interrupted.reason.message)
            return False
        finally:
            results.close()
            self._save_progress(results, is_due=True)
        return True

    def _save_progress(self, results: ResultsLog, is_due: bool = False) -> None:
        if is_due or time.monotonic() - self._saved_s >= PROGRESS_SAVE_S:
            total = self.batch["request_counts"]["total"]
            progress = self._run_progress.of(total, results.total_completed + results.total_failed,
                                             results.total_prompt_tokens, results.total_generated_tokens)
            self._save(request_counts={"total": total, "completed": results.total_completed,
                                       "failed": results.total_failed}, progress=progress)

    def fail(self, code: str, message: str) -> bool:
        """End the job `failed` with one error (its finished lines stay in its results log)."""
        self._save(status=FAILED, failed_at=int(time.time()),
                   errors={"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]})
        return True

    def _finish(self, status: str) -> bool:
        """Write the output and error files from the results log, then the job's end."""
        batch_id, now = self.batch["id"], int(time.time())
        if status == COMPLETED and self.batch["status"] != FINALIZING:
            self._save(status=FINALIZING, finalizing_at=now)
        results = ResultsLog(self.store.results_path(batch_id))  # its counts, as the log holds them
        results.close()
        counts = {"total": self.batch["request_counts"]["total"], "completed": results.total_completed,
                  "failed": results.total_failed}
        if os.path.exists(self.input_path):
            file_ids = self._write_files(functools.partial(self._expired_line, counts) if status == EXPIRED else None)
        else:
            file_ids = {"output_file_id": None, "error_file_id": None}
        ended = {COMPLETED: "completed_at", CANCELLED: "cancelled_at", EXPIRED: "expired_at"}[status]
        if status == CANCELLED:
            file_ids["cancelling_at"] = self.store.cancel_asked_at(batch_id)
        self._save(status=status, request_counts=counts, **file_ids, **{ended: now})
        log.info("cbatch jobs: %s %s (%d completed, %d failed)", batch_id, status, counts["completed"],
                 counts["failed"])
        return True

    @staticmethod
    def _expired_line(counts: dict, custom_id) -> dict:
        """The error line of a request the window ended before it was answered (counted failed)."""
        counts["failed"] += 1
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
                "error": EXPIRED_ERROR}

    def _write_files(self, unanswered) -> dict:
        batch_id, files = self.batch["id"], self.store.files
        results_path = self.store.results_path(batch_id)
        kinds = {"output_file_id": "output", "error_file_id": "error"}
        temporary = {name: tempfile.NamedTemporaryFile(dir=files.dir, prefix=".tmp-", delete=False) for name in kinds}
        try:
            write_outputs(results_path, self.input_path, self.batch["endpoint"], temporary["output_file_id"],
                          temporary["error_file_id"], unanswered)
            file_ids = {}
            for name, out in temporary.items():
                out.flush()
                os.fsync(out.fileno())
                num_bytes = out.tell()
                out.close()
                file_id = output_file_id(batch_id, kinds[name])
                if num_bytes == 0:  # OpenAI's: no file for no lines
                    os.remove(out.name)
                    file_ids[name] = None
                    continue
                os.replace(out.name, files.content_path(file_id))
                fsync_dir(files.dir)
                files.add(file_id, num_bytes, f"{batch_id}_{kinds[name]}.jsonl", BATCH_OUTPUT, self.batch.get(OWNER))
                file_ids[name] = file_id
            return file_ids
        finally:
            for out in temporary.values():
                with contextlib.suppress(OSError):  # a full disk fails the close's flush: remove it all the same
                    out.close()
                if os.path.exists(out.name):
                    os.remove(out.name)
