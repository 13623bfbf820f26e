"""Prometheus metrics of the HTTP server: what it sees itself, plus the daemon's stats.

The HTTP process counts its requests and times their tokens; the daemon-wide figures
(queue, active sequences, steps, prefix-cache reuse) come from the front-end's STATS
reply, read when /metrics is scraped.
"""

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

disable_created_metrics()  # no *_created series: they double the text and no dashboard reads them

# Latency buckets in seconds: tokens come every few ms on a GPU, every 10-100 ms on a CPU.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GAUGE, COUNTER = GaugeMetricFamily, CounterMetricFamily
# STATS key -> (metric kind, name, help): gauges go up and down, counters count since the worker started
_DAEMON_FIGURES = {
    "num_queued": (GAUGE, "cbatch_queue_depth", "Requests waiting for a sequence slot"),
    "num_active": (GAUGE, "cbatch_active_sequences", "Sequences being decoded"),
    "parallel": (GAUGE, "cbatch_parallel", "Sequence slots"),
    "kv_cells_used": (GAUGE, "cbatch_kv_cells_used", "KV cells in use (a shared cell once)"),
    "kv_cells_total": (GAUGE, "cbatch_kv_cells_total", "KV cells in the context"),
    "decode_tokens_per_s": (GAUGE, "cbatch_decode_tokens_per_second", "Generated tokens per second of decode steps"),
    "num_steps": (COUNTER, "cbatch_decode_steps", "Decode steps (one llama_decode each) since the worker started"),
    "num_requests_ended": (COUNTER, "cbatch_daemon_requests_ended",
                           "Requests the daemon ended (any outcome), all clients"),
    "prompt_tokens_computed": (COUNTER, "cbatch_prompt_tokens_computed",
                               "Prompt tokens computed (not served by the prefix cache)"),
    "prompt_tokens_reused": (COUNTER, "cbatch_prompt_tokens_reused", "Prompt tokens reused from the prefix cache"),
    "host_cache_bytes": (GAUGE, "cbatch_host_cache_bytes", "Bytes of saved KV states in host memory (--cache-ram)"),
    "host_cache_entries": (GAUGE, "cbatch_host_cache_entries", "Saved prefixes indexed (in host memory or on disk)"),
    "host_cache_saved": (COUNTER, "cbatch_host_cache_saved", "KV states saved to host memory"),
    "host_cache_tokens_restored": (COUNTER, "cbatch_host_cache_tokens_restored",
                                   "Prompt tokens restored from saved states (host memory or disk)"),
    "host_cache_evictions": (COUNTER, "cbatch_host_cache_evictions",
                             "Saved states dropped from host memory for room (kept on disk where it holds them)"),
    "disk_cache_bytes": (GAUGE, "cbatch_disk_cache_bytes", "Bytes of saved KV states in --cache-dir"),
    "disk_cache_files": (GAUGE, "cbatch_disk_cache_files", "Saved KV state files in --cache-dir"),
    "disk_cache_written": (COUNTER, "cbatch_disk_cache_written", "KV state files written to --cache-dir"),
    "disk_cache_loaded": (COUNTER, "cbatch_disk_cache_loaded", "KV state files read back from --cache-dir"),
    "disk_cache_skipped": (COUNTER, "cbatch_disk_cache_skipped",
                           "KV state files skipped and removed: truncated, corrupt or foreign"),
    "num_preemptions": (COUNTER, "cbatch_preemptions",
                        "Running sequences sent back to the queue (for an interactive request, or for KV room)"),
    "num_embedding_decodes": (COUNTER, "cbatch_embedding_decodes",
                              "Embedding decodes (the inputs of several callers share one)"),
    "num_embedding_inputs": (COUNTER, "cbatch_embedding_inputs", "Inputs embedded, all clients"),
}
# ... and what each tenant (API key name) was served since the daemon started, all clients
_TENANT_COUNTERS = {
    "num_requests": ("cbatch_tenant_requests", "Requests of the tenant that finished"),
    "num_prompt_tokens": ("cbatch_tenant_prompt_tokens", "Prompt tokens of the tenant's finished requests"),
    "num_generated_tokens": ("cbatch_tenant_generated_tokens", "Tokens generated for the tenant's finished requests"),
}


# a batch job's figure (cbatch.jobs.overview) -> (metric name, help), for each job not ended
_JOB_GAUGES = {
    "total": ("cbatch_batch_job_lines_total", "Lines of the batch job's input file"),
    "done": ("cbatch_batch_job_lines_done", "Lines of the batch job answered (completed or failed)"),
    "failed": ("cbatch_batch_job_lines_failed", "Lines of the batch job that failed"),
    "prompt_tokens": ("cbatch_batch_job_prompt_tokens", "Prompt tokens of the batch job's answered lines"),
    "generated_tokens": ("cbatch_batch_job_generated_tokens", "Tokens generated for the batch job's answered lines"),
    "lines_per_s": ("cbatch_batch_job_lines_per_second", "Lines of the batch job answered per second, this run"),
}


def _one_value(family_class, name: str, help_text: str, value: float):
    family = family_class(name, help_text)
    family.add_metric([], float(value))
    return family


class _DaemonStats:
    """A collector that reports the last STATS reply (read just before each scrape)."""

    def __init__(self):
        self.stats: dict = {}

    def collect(self):
        for key, (family_class, name, help_text) in _DAEMON_FIGURES.items():
            if self.stats.get(key) is not None:
                yield _one_value(family_class, name, help_text, self.stats[key])
        yield from cache_tier_counters(self.stats)
        yield from router_gauges(self.stats)
        yield from job_gauges(self.stats.get("jobs"))
        tenants = self.stats.get("tenants") or {}
        for key, (name, help_text) in _TENANT_COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["tenant"])
            for tenant, usage in tenants.items():
                family.add_metric([tenant], float(usage[key]))
            yield family


def cache_tier_counters(stats: dict):
    """Admissions served by each KV cache tier (device: a slot's cached prefix; host and
    disk: a saved state restored), and those none served."""
    if "kv_cache_lookups" not in stats:
        return
    hits = {"device": stats["kv_cache_device_hits"], "host": stats.get("host_cache_hits", 0),
            "disk": stats.get("disk_cache_hits", 0)}
    family = CounterMetricFamily("cbatch_kv_cache_hits", "Admissions whose prompt prefix a KV cache tier served",
                                 labels=["tier"])
    for tier, count in hits.items():
        family.add_metric([tier], float(count))
    yield family
    yield _one_value(COUNTER, "cbatch_kv_cache_misses", "Admissions no KV cache tier served a prefix of",
                     stats["kv_cache_lookups"] - sum(hits.values()))


def job_gauges(jobs: dict | None):
    """Batch jobs by status, and the lines and tokens of each job not ended (by batch_id and
    status; a job's series go when it ends). None: the daemon serves no batch jobs."""
    if jobs is None:
        return
    family = GaugeMetricFamily("cbatch_batch_jobs", "Batch jobs in the state directory by status", labels=["status"])
    for status, count in jobs["num_by_status"].items():
        family.add_metric([status], float(count))
    yield family
    runner = jobs.get("runner")
    if runner is not None:
        yield GaugeMetricFamily("cbatch_batch_job_runner_up", "1 while the batch job runner runs, 0 while it is "
                                "restarted after dying", value=float(runner["is_running"]))
        yield GaugeMetricFamily("cbatch_batch_job_runner_quick_deaths", "Times in a row the batch job runner "
                                "exited just after its start (0 once it keeps running)",
                                value=float(runner["num_quick_deaths"]))
    for key, (name, help_text) in _JOB_GAUGES.items():
        family = GaugeMetricFamily(name, help_text, labels=["batch_id", "status"])
        for job in jobs["active"]:
            value = job["completed"] + job["failed"] if key == "done" else job[key]
            family.add_metric([job["id"], job["status"]], float(value))
        yield family


def kv_cache_usage(stats: dict) -> float:
    """The fraction of KV cells in use, 0 to 1."""
    return stats["kv_cells_used"] / stats["kv_cells_total"] if stats.get("kv_cells_total") else 0.0


def router_gauges(stats: dict):
    """The load gauges under the names that routers and gateways already scrape from vLLM
    (load-aware policies, the Kubernetes inference gateway), beside cbatch's own."""
    if "num_active" not in stats:
        return
    for name, help_text, value in (
            ("vllm:num_requests_running", "Requests being decoded", stats["num_active"]),
            ("vllm:num_requests_waiting", "Requests waiting for a sequence slot", stats["num_queued"]),
            ("vllm:kv_cache_usage_perc", "Fraction of KV cache cells in use (0 to 1)", kv_cache_usage(stats))):
        yield _one_value(GaugeMetricFamily, name, help_text, value)


class HttpMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("cbatch_http_requests",
                                "Finished choices (embeddings: requests) by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=self.registry)
        self.errors = Counter("cbatch_http_errors", "Requests answered with an error, by status and cbatch code",
                              ["endpoint", "status", "code"], registry=self.registry)
        self.prompt_tokens = Counter("cbatch_http_prompt_tokens",
                                     "Prompt tokens of finished requests, once per prompt as usage counts them",
                                     registry=self.registry)
        self.generated_tokens = Counter("cbatch_http_generated_tokens", "Tokens generated for finished requests",
                                        registry=self.registry)
        self.disconnects = Counter("cbatch_http_disconnects",
                                   "Requests whose client hung up before the response ended (their work is cancelled)",
                                   ["endpoint"], registry=self.registry)
        self.ttft = Histogram("cbatch_http_time_to_first_token_seconds", "From request arrival to its first token",
                              buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.itl = Histogram("cbatch_http_inter_token_latency_seconds",
                             "Time between successive tokens of a choice as the server receives them",
                             buckets=ITL_BUCKETS_S, registry=self.registry)
        self._daemon = _DaemonStats()
        self.registry.register(self._daemon)
        # With several HTTP processes (the daemon then sets PROMETHEUS_MULTIPROC_DIR), the
        # counters above live in files shared by all of them, and a scrape sums the files.
        self._scraped = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self._scraped = CollectorRegistry()
            MultiProcessCollector(self._scraped)
            self._scraped.register(self._daemon)

    def on_finished(self, endpoint: str, finish_reason: str, usage: dict | None, is_new_prompt: bool) -> None:
        """One finished choice; is_new_prompt is false for the other choices of a prompt
        (`n` > 1), whose prompt tokens were counted with the first."""
        self.requests.labels(endpoint, finish_reason).inc()
        if usage:
            if is_new_prompt:
                self.prompt_tokens.inc(usage["prompt_tokens"])
            self.generated_tokens.inc(usage["completion_tokens"])

    def on_embedded(self, prompt_tokens: int) -> None:
        """One answered embeddings request: a request under the finish reason `embedded`."""
        self.requests.labels("embeddings", "embedded").inc()
        self.prompt_tokens.inc(prompt_tokens)

    def render(self, daemon_stats: dict) -> bytes:
        self._daemon.stats = daemon_stats
        return generate_latest(self._scraped)


class TokenTimer:
    """Times one choice's tokens: the first against the request's arrival, the rest
    against the previous arrival (a chunk of k tokens counts its gap as k gaps of 1/k)."""

    def __init__(self, metrics: HttpMetrics, arrived_s: float):
        self._metrics = metrics
        self._last_s = arrived_s
        self._is_first = True

    def on_tokens(self, num_tokens: int, now_s: float) -> None:
        if not num_tokens:
            return
        gap_s = now_s - self._last_s
        self._last_s = now_s
        if self._is_first:
            self._is_first = False
            self._metrics.ttft.observe(gap_s)
            num_tokens -= 1
            gap_s = 0.0
        for _ in range(num_tokens):
            self._metrics.itl.observe(gap_s / num_tokens)
