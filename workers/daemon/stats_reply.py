"""What the daemon's STATS reply holds: the decode worker's figures, the requests in
flight and ended, each tenant's usage, and, when the daemon serves HTTP, its batch jobs
(cbatch.jobs.overview: a count per status and the progress of each job not ended, read
from the state directory the job runner writes)."""

from cbatch.config import DaemonConfig
from cbatch.jobs.batches import BatchStore
from cbatch.jobs.overview import JobsOverview


class StatsReply:
    def __init__(self, config: DaemonConfig):
        self.config = config
        self.jobs = JobsOverview(BatchStore(config.state_dir)) if config.state_dir else None
        # callable() -> the job runner process's state (ChildProcess.state), set by the
        # supervisor when it runs one; None otherwise.
        self.job_runner_state = None

    def batch_jobs_health(self) -> str | None:
        """For HEALTH: "running" while the job runner runs, "restarting" while it is down
        (it died, and is started again after its back-off); None without batch jobs."""
        if not self.job_runner_state:
            return None
        return "running" if self.job_runner_state()["is_running"] else "restarting"

    def of(self, front_end) -> dict:
        """The figures of `front_end` (a FrontEnd) now."""
        ended = front_end.requests.num_ended_by_outcome
        stats = {"num_active": 0, "num_queued": 0, **front_end.worker.stats, "parallel": self.config.engine.parallel,
                 "num_in_flight": len(front_end.requests.active), "num_requests_ended": sum(ended.values()),
                 "num_requests_by_outcome": dict(ended), "num_fetches": front_end.num_fetches,
                 "tenants": front_end.requests.ledger.stats()}
        if self.jobs is not None:
            stats["jobs"] = self.jobs.read()
            if self.job_runner_state:
                stats["jobs"]["runner"] = self.job_runner_state()
        return stats
