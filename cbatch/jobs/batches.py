"""Batch jobs as OpenAI's Batches API shows them, kept in `batches/<id>.json`.

One writer per job object, so no two processes race on it: the HTTP server writes it
once, when the job is created (status validating); from then on only the job runner
(cbatch.jobs.job_runner) does. A cancel is a marker file of its own (`<id>.cancel`) that
the runner honours; until the runner has, the job shows as cancelling.

Beside OpenAI's fields a job has cbatch's `progress` (cbatch.jobs.progress), written by
the runner as it runs, and, stored but never shown, the tenant of the API key that
created it: its lines run as that tenant, and only that tenant's keys see it.
"""

import os
import time
import uuid

from cbatch.errors import INVALID_REQUEST, NOT_FOUND, CbatchError
from cbatch.jobs.files import BATCH, MAX_ID_CHARS, OWNER, FileStore, is_visible, public
from cbatch.jobs.progress import initial_progress
from cbatch.jobs.state_dir import STATE_DIR_MODE, fsync_dir, read_json, write_json

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
VALIDATING, IN_PROGRESS, FINALIZING = "validating", "in_progress", "finalizing"
COMPLETED, FAILED, EXPIRED, CANCELLING, CANCELLED = "completed", "failed", "expired", "cancelling", "cancelled"
FINAL_STATUSES = (COMPLETED, FAILED, EXPIRED, CANCELLED)


def batch_object(batch_id: str, input_file_id: str, endpoint: str, completion_window: str, metadata) -> dict:
    now = int(time.time())
    return {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
            "completion_window": completion_window, "status": VALIDATING, "output_file_id": None,
            "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + COMPLETION_WINDOWS[completion_window], "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
            "progress": initial_progress()}


def _check_create(body, files: FileStore, viewer: str | None) -> None:
    if not isinstance(body, dict):
        raise CbatchError(INVALID_REQUEST, "the body must be a JSON object")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise CbatchError(INVALID_REQUEST, f"{name} is required (a string)")
    if body["endpoint"] not in ENDPOINTS:
        raise CbatchError(INVALID_REQUEST, f"endpoint {body['endpoint']!r} is not served in batches; "
                                           f"this server takes {list(ENDPOINTS)}")
    if body["completion_window"] not in COMPLETION_WINDOWS:
        raise CbatchError(INVALID_REQUEST, f"completion_window must be one of {list(COMPLETION_WINDOWS)}")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(value, str) for value in metadata.values())):
        raise CbatchError(INVALID_REQUEST, "metadata must be an object of strings")
    if files.get(body["input_file_id"], viewer)["purpose"] != BATCH:
        raise CbatchError(INVALID_REQUEST, f"input_file_id {body['input_file_id']!r} was not uploaded with "
                                           f"purpose {BATCH!r}")


class BatchStore:
    def __init__(self, root: str):
        self.dir = os.path.join(root, "batches")
        os.makedirs(self.dir, mode=STATE_DIR_MODE, exist_ok=True)
        self.files = FileStore(root)

    def _path(self, batch_id: str, suffix: str) -> str:
        return os.path.join(self.dir, f"{batch_id}{suffix}")

    def results_path(self, batch_id: str) -> str:
        return self._path(batch_id, ".results.jsonl")

    def input_path(self, batch_id: str) -> str:
        """The job's own link to its input file's bytes, which deleting the file leaves in place."""
        return self._path(batch_id, ".input.jsonl")

    def create(self, body, tenant: str | None = None) -> dict:
        """A new job of `tenant` (None: the daemon checks no keys), from one of its files."""
        _check_create(body, self.files, tenant)
        batch = batch_object(f"batch_{uuid.uuid4().hex}", body["input_file_id"], body["endpoint"],
                             body["completion_window"], body.get("metadata"))
        self.save({**batch, OWNER: tenant})
        return batch

    def save(self, batch: dict) -> None:
        write_json(self._path(batch["id"], ".json"), batch)

    def stored(self, batch_id: str) -> dict | None:
        """The job as last written, or None."""
        is_id = batch_id.startswith("batch_") and batch_id[6:].isalnum() and len(batch_id) <= MAX_ID_CHARS
        return read_json(self._path(batch_id, ".json")) if is_id else None

    def cancel_asked_at(self, batch_id: str) -> int | None:
        try:
            return int(os.stat(self._path(batch_id, ".cancel")).st_mtime)
        except FileNotFoundError:
            return None

    def get(self, batch_id: str, viewer: str | None = None) -> dict:
        """The job as a caller of tenant `viewer` sees it: cancelling from the cancel on,
        until the runner ends it; another tenant's job is as unknown as a missing one."""
        batch = self.stored(batch_id)
        if batch is None or not is_visible(batch, viewer):
            raise CbatchError(NOT_FOUND, f"no batch with id {batch_id!r}")
        cancelled_at = self.cancel_asked_at(batch_id)
        if cancelled_at is not None and batch["status"] not in FINAL_STATUSES:
            batch = {**batch, "status": CANCELLING, "cancelling_at": cancelled_at}
        return public(batch)

    def ids(self) -> list[str]:
        return [name[:-5] for name in os.listdir(self.dir) if name.endswith(".json")]

    def list(self, viewer: str | None = None) -> list[dict]:
        """Newest first."""
        batches = []
        for batch_id in self.ids():
            try:
                batches.append(self.get(batch_id, viewer))
            except CbatchError:
                continue  # deleted meanwhile
        return sorted(batches, key=lambda batch: (batch["created_at"], batch["id"]), reverse=True)

    def cancel(self, batch_id: str, viewer: str | None = None) -> dict:
        """Ask the runner to stop the job; a finished job is left as it is (OpenAI's answer)."""
        batch = self.get(batch_id, viewer)
        if batch["status"] in FINAL_STATUSES:
            raise CbatchError(INVALID_REQUEST, f"batch {batch_id} is {batch['status']}: it cannot be cancelled")
        if batch["status"] != CANCELLING:
            with open(self._path(batch_id, ".cancel"), "a"):
                pass
            fsync_dir(self.dir)  # a cancel answered survives a crash
        return self.get(batch_id, viewer)
