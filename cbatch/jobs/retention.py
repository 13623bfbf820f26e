"""What the state directory lets go of, so that it does not grow for ever; the job runner
looks at startup and every RETENTION_CHECK_S.

- Temporary files (`.tmp-*`) that a crash left behind mid-write, once STALE_WRITE_S old
  (no write of the directory's takes that long, a 200 MB upload included).
- The bytes of an upload whose object is missing (a crash between writing the two, or a
  delete cut short), once STALE_WRITE_S old: without its object the file never existed.
- Ended jobs `retention_s` after they ended (`--batch-retention-days`; 0 keeps them):
  the job's object, results log, input link and cancel marker, and the output and error
  files it made. Uploaded input files stay until they are deleted, as OpenAI's do.
"""

import logging
import os
import time

from cbatch.jobs.batches import FINAL_STATUSES, BatchStore
from cbatch.jobs.state_dir import remove_if_present

log = logging.getLogger("cbatch.jobs")

RETENTION_CHECK_S = 600.0
STALE_WRITE_S = 3600.0
ENDED_AT_FIELDS = ("completed_at", "failed_at", "expired_at", "cancelled_at")
JOB_SUFFIXES = (".json", ".results.jsonl", ".input.jsonl", ".cancel")


def _is_stale(path: str, now: float) -> bool:
    try:
        return now - os.stat(path).st_mtime >= STALE_WRITE_S
    except FileNotFoundError:
        return False


def collect_leftovers(store: BatchStore, now: float) -> int:
    """Remove stale temporary files and uploads without an object; how many were removed."""
    num_removed = 0
    for directory in (store.dir, store.files.dir):
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            is_orphan = (directory == store.files.dir and name.endswith(".jsonl")
                         and not os.path.exists(path[:-len(".jsonl")] + ".json"))
            if (name.startswith(".tmp-") or is_orphan) and _is_stale(path, now):
                remove_if_present(path)
                num_removed += 1
    return num_removed


def remove_ended_jobs(store: BatchStore, retention_s: float, now: float) -> int:
    """Remove the jobs that ended `retention_s` ago or more, with the files they made; how many."""
    num_removed = 0
    for batch_id in store.ids():
        batch = store.stored(batch_id)
        if batch is None or batch["status"] not in FINAL_STATUSES:
            continue
        ended_at = max((batch.get(field) or 0) for field in ENDED_AT_FIELDS)
        if now - ended_at < retention_s:
            continue
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            if file_id:
                remove_if_present(store.files.object_path(file_id))  # first: a file without its object is gone
                remove_if_present(store.files.content_path(file_id))
        for suffix in JOB_SUFFIXES[1:] + JOB_SUFFIXES[:1]:  # the object last: until then the job is seen and retried
            remove_if_present(os.path.join(store.dir, f"{batch_id}{suffix}"))
        num_removed += 1
    return num_removed


def let_go(store: BatchStore, retention_s: float) -> None:
    """One look over the state directory (retention_s 0: ended jobs are kept)."""
    now = time.time()
    num_leftovers = collect_leftovers(store, now)
    num_jobs = remove_ended_jobs(store, retention_s, now) if retention_s > 0 else 0
    if num_leftovers or num_jobs:
        log.info("cbatch jobs: removed %d ended jobs past --batch-retention-days and %d files left by "
                 "interrupted writes", num_jobs, num_leftovers)
