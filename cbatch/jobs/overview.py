"""What the jobs of a state directory are doing, for the daemon's STATS reply (and so
cbatch-status and /metrics): how many jobs are in each status, and each job not ended
with its counts and progress."""

from collections import Counter

from cbatch.errors import CbatchError
from cbatch.jobs.batches import FINAL_STATUSES, BatchStore
from cbatch.jobs.progress import initial_progress

MAX_JOBS_SHOWN = 100  # jobs not ended listed in a reply, the oldest (the running one first); the counts cover all


def job_line(batch: dict) -> dict:
    """What cbatch-status and /metrics show of a job that has not ended."""
    counts = batch["request_counts"]
    return {"id": batch["id"], "status": batch["status"], "endpoint": batch["endpoint"], "total": counts["total"],
            "completed": counts["completed"], "failed": counts["failed"],
            **(batch.get("progress") or initial_progress())}


class JobsOverview:
    """The jobs of a state directory: how many there are in each status, and the ones not
    ended, oldest first (the order the runner takes them). An ended job never changes, so it
    is read once and then only counted."""

    def __init__(self, store: BatchStore):
        self.store = store
        self._ended: dict[str, str] = {}  # batch id -> its final status

    def read(self) -> dict:
        num_by_status: Counter = Counter()
        active = []
        for batch_id in self.store.ids():
            status = self._ended.get(batch_id)
            if status is None:
                try:
                    batch = self.store.get(batch_id)
                except CbatchError:
                    continue  # not a job's file
                status = batch["status"]
                if status in FINAL_STATUSES:
                    self._ended[batch_id] = status
                else:
                    active.append(batch)
            num_by_status[status] += 1
        active.sort(key=lambda batch: (batch["created_at"], batch["id"]))
        return {"num_by_status": dict(num_by_status), "num_active": len(active),
                "active": [job_line(batch) for batch in active[:MAX_JOBS_SHOWN]]}
