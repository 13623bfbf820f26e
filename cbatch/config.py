"""Engine settings: one dataclass, validated once; the CLI maps its flags onto it."""

import os
from dataclasses import dataclass

from cbatch.errors import INVALID_CONFIG, CbatchError
from cbatch.images import MAX_IMAGE_BYTES, MAX_IMAGES
from cbatch.params import MAX_TIMEOUT_S
from cbatch.wording import counted

MAX_PARALLEL = 256  # llama.cpp's LLAMA_MAX_SEQ: each running sequence holds a KV sequence id
DEFAULT_CTX_PER_SEQ = 4096
MAX_SEQ_IDS = 256  # llama.cpp's LLAMA_MAX_SEQ: KV sequence ids for running and cached prefixes
SEQ_IDS_PER_RUNNING = 4  # ids beyond `parallel` hold cached prefixes; each costs a logits row
POOLING_NAMES = ("mean", "cls", "last")
MAX_QUEUE = 16384  # keeps every message about the queue (a drain's cancels) within the protocol's limits
QUEUE_FLAGS = ("--max-queue", "--max-batch-queue")  # each priority's queue limit, by is_batch (as params.PRIORITIES)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # None = the embedded default model
    parallel: int = 4  # sequences decoded together = KV sequence slots
    ctx_size: int = 0  # total context shared by all slots, as llama.cpp's server; 0 = 4096 per slot
    batch_size: int = 512  # tokens per step: decode tokens first, prompt chunks fill the rest
    threads: int = 0  # 0 = the CPUs this process may run on (num_usable_cpus)
    n_gpu_layers: int = -1  # -1 = every layer on a GPU build of llama.cpp, none on a CPU build
    # Each priority's own room: interactive (batch) requests waiting beyond `parallel`; more
    # of that priority are rejected with queue_full. A max_batch_queue of None = max_queue.
    max_queue: int = 1024
    max_batch_queue: int | None = None
    # One KV stream per sequence (a token attends over its own stream only) rather than one
    # pool for all (each token attends over the pool's whole used range): measured faster
    # on short and on long independent prompts, and level on shared prefixes (README).
    kv_unified: bool = False
    # Reuse the KV of cached prompt prefixes; off for A/B runs.
    prefix_cache: bool = True
    # An interactive request that finds every slot taken preempts a running batch sequence
    # (workers/engine/sched/preemption.py) rather than wait for one to end.
    preempt_batch: bool = True
    # A request paused this long in all for its slow client (seconds since its admission)
    # gives its slot to waiting requests, its KV kept, and resumes once its client catches
    # up (workers/engine/sched/scheduler.py).
    park_after_s: float = 30.0
    # Admission within a priority shares the steps among tenants by weight
    # (workers/engine/sched/fair_share.py); off, it is in arrival order, whoever sends more.
    fair_share: bool = True
    # Unified pool only: cells kept for finished requests' prefixes beyond what running
    # ones hold; 0 = one sequence's context. Every token attends over the pool's used
    # range, so idle cached cells are not free: this bounds what they add.
    cache_tokens: int = 0
    # The host-memory tier below the KV slots (workers/engine/kv/host_tier.py): MiB of saved
    # prefix states, so conversations beyond the slots come back at the cost of their new
    # tokens; -1 = as llama-server (8192), at most a quarter of the memory available at
    # start; 0 = off.
    cache_ram_mib: int = -1
    # The disk tier below it (kv/disk_tier.py): saved states kept in this directory across
    # restarts, at most cache_dir_max_gb of them; "" = off.
    cache_dir: str = ""
    cache_dir_max_gb: float = 16.0
    # Leave Claude Code's per-request billing line in the system prompt of chats over HTTP
    # (cbatch/openai/billing_header.py); by default it is removed, so turns share a prefix.
    keep_billing_header: bool = False
    # Sample inside llama_decode's graph when the request allows (only token ids come back);
    # None = on with a GPU build of llama.cpp, off on a CPU build (measured: README).
    backend_sampling: bool | None = None
    # Queue step N+1's llama_decode before step N's text and publishing, so they run while
    # it decodes; None = on when layers are offloaded to a GPU, off on a CPU (where the
    # decode thread would take a core from llama.cpp's own threads). Same tokens either way.
    overlap: bool | None = None
    # Embeddings of a model whose GGUF declares no pooling (a causal LM): mean, cls or last.
    pooling: str = "mean"
    # Thinking in tags (workers/engine/thinking/tags.py): "auto" reads the tags off the chat
    # template, or takes reasoning_tags when given; "off" leaves every output as it is.
    reasoning: str = "auto"
    reasoning_tags: tuple[str, str] | None = None
    # A vision projector (mmproj GGUF) for the model: chat messages may then carry images,
    # each within these bounds (workers/engine/vision.py). None = the model takes no images.
    mmproj_path: str | None = None
    max_images: int = 8  # per request
    max_image_bytes: int = MAX_IMAGE_BYTES  # per image file
    max_image_pixels: int = 4096 * 4096  # per image, decoded

    def __post_init__(self):
        def check(ok: bool, message: str):
            if not ok:
                raise CbatchError(INVALID_CONFIG, message)

        check(1 <= self.parallel <= MAX_PARALLEL, f"--parallel must be in [1, {MAX_PARALLEL}], got {self.parallel}")
        check(self.ctx_size >= 0, f"--ctx-size must be >= 0, got {self.ctx_size}")
        check(
            self.ctx_size == 0 or self.ctx_size // self.parallel >= 16,
            f"--ctx-size {self.ctx_size} leaves {counted(self.ctx_size // self.parallel, 'token')} per sequence "
            f"for --parallel {self.parallel}; raise --ctx-size or lower --parallel",
        )
        check(
            self.batch_size >= self.parallel,
            f"--batch-size {self.batch_size} must be at least --parallel {self.parallel}: "
            "every step carries one token for each generating sequence",
        )
        check(self.threads >= 0, f"--threads must be >= 0, got {self.threads}")
        check(self.n_gpu_layers >= -1, f"--n-gpu-layers must be >= -1, got {self.n_gpu_layers}")
        check(self.park_after_s > 0, f"--park-after must be > 0 (seconds), got {self.park_after_s:g}")
        check(self.cache_tokens >= 0, f"--cache-tokens must be >= 0, got {self.cache_tokens}")
        check(self.cache_ram_mib >= -1, f"--cache-ram must be >= 0 (MiB), got {self.cache_ram_mib}")
        check(not self.cache_dir or self.cache_ram_mib != 0,
              "--cache-dir needs the host-memory tier: leave out --cache-ram 0")
        check(self.cache_dir_max_gb > 0, f"--cache-dir-max-gb must be > 0, got {self.cache_dir_max_gb:g}")
        check(self.pooling in POOLING_NAMES,
              f"--pooling must be one of {', '.join(POOLING_NAMES)}, got {self.pooling!r}")
        check(self.reasoning in ("auto", "off"), f"--reasoning must be auto or off, got {self.reasoning!r}")
        check(self.reasoning_tags is None or (len(self.reasoning_tags) == 2 and all(self.reasoning_tags)),
              "--reasoning-tags takes two non-empty tags: OPEN CLOSE")
        check(1 <= self.max_images <= MAX_IMAGES, f"--max-images must be in [1, {MAX_IMAGES}], got {self.max_images}")
        check(1 <= self.max_image_bytes <= MAX_IMAGE_BYTES,
              f"--max-image-bytes must be in [1, {MAX_IMAGE_BYTES}], got {self.max_image_bytes}")
        check(self.max_image_pixels >= 1, f"--max-image-pixels must be >= 1, got {self.max_image_pixels}")
        if self.max_batch_queue is None:
            object.__setattr__(self, "max_batch_queue", self.max_queue)
        for flag, value in zip(QUEUE_FLAGS, self.max_queues):
            check(0 <= value <= MAX_QUEUE, f"{flag} must be in [0, {MAX_QUEUE}], got {value}")

    @property
    def max_queues(self) -> tuple[int, int]:
        """The queue limit of each priority, by is_batch."""
        return self.max_queue, self.max_batch_queue

    @property
    def max_in_flight(self) -> tuple[int, int]:
        """The requests of each priority, by is_batch, admitted at once: running and waiting."""
        return self.parallel + self.max_queue, self.parallel + self.max_batch_queue

    @property
    def total_ctx(self) -> int:
        return self.ctx_size or DEFAULT_CTX_PER_SEQ * self.parallel

    @property
    def ctx_per_seq(self) -> int:
        return self.total_ctx // self.parallel

    @property
    def max_cached_cells(self) -> int:
        return self.cache_tokens or self.ctx_per_seq

    @property
    def num_seq_ids(self) -> int:
        return min(MAX_SEQ_IDS, SEQ_IDS_PER_RUNNING * self.parallel)

    @property
    def num_threads(self) -> int:
        return self.threads or num_usable_cpus()


LOOPBACK_HOSTS = ("localhost", "[::1]", "::1")  # and 127.0.0.0/8
MAX_IPC_PATH_BYTES = 107  # sun_path of a Unix socket, less its terminating NUL
RING_CAPACITY_RECORDS = 1 << 16  # 64k records x 64 bytes = 4 MiB of shared memory
MAX_HTTP_PROCESSES = 16
MAX_DEFAULT_HTTP_PROCESSES = 4
CPUS_PER_HTTP_PROCESS = 8
RETENTION_S = 60.0  # how long a finished request's records stay fetchable (ring overrun recovery)
DRAIN_GRACE_S = 30.0  # on SIGTERM, in-flight requests get this long before they are cancelled
# Past libzmq's heartbeat timeout (3 s: a peer silent that long is disconnected), as long
# as a connected client that stops reading is given (MAX_STALL_S).
RECONNECT_GRACE_S = 10.0
WORKER_TIMEOUT_S = 120.0  # longer than any single decode step should take
MAX_ALIAS_CHARS = 256
PROGRESS_INTERVAL_S = 10.0  # the daemon logs a progress line this often while it has requests


def runtime_dir() -> str:
    """Owner-only directory for ipc:// socket files and lock files."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    path = os.path.join(base, f"cbatch-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_uid != os.getuid():
        raise CbatchError(INVALID_CONFIG, f"{path} belongs to another user; set XDG_RUNTIME_DIR")
    return path


def default_endpoint() -> str:
    """CBATCH_ENDPOINT if set, else an ipc:// socket in the owner-only runtime directory."""
    return os.environ.get("CBATCH_ENDPOINT") or f"ipc://{os.path.join(runtime_dir(), 'cbatch.sock')}"


def _is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def num_usable_cpus() -> int:
    """The CPUs in this process's affinity mask (taskset, cgroup cpusets, a container's
    CPU set), not the machine's: llama.cpp's threads spin at their barriers, so more
    threads than usable CPUs slow every step down by orders of magnitude."""
    return len(os.sched_getaffinity(0)) or 1


def default_http_processes() -> int:
    """One HTTP process per 8 CPUs this process may run on, at least 1 and at most 4. A
    process needs a core of its own to add anything: on fewer CPUs the decode worker's
    threads, the front-end and one HTTP process already fill them."""
    return max(1, min(MAX_DEFAULT_HTTP_PROCESSES, num_usable_cpus() // CPUS_PER_HTTP_PROCESS))


def parse_http_address(value: str) -> tuple[str, int]:
    """`--http [HOST:]PORT` -> (host, port); the host defaults to 127.0.0.1."""
    host, _, port = value.rpartition(":")
    try:
        return (host.strip("[]") or "127.0.0.1"), int(port)
    except ValueError:
        raise CbatchError(INVALID_CONFIG, f"--http takes [HOST:]PORT, got {value!r}") from None


@dataclass(frozen=True)
class DaemonConfig:
    engine: EngineConfig
    endpoint: str = ""  # "" = default_endpoint()
    ring_capacity: int = RING_CAPACITY_RECORDS
    drain_grace_s: float = DRAIN_GRACE_S
    retention_s: float = RETENTION_S
    # A client whose connection died keeps its requests this long, for it to come back
    # under its routing id (a paused process, a network blip); 0 = cancel them at once.
    reconnect_grace_s: float = RECONNECT_GRACE_S
    worker_timeout_s: float = WORKER_TIMEOUT_S  # a worker silent this long is killed and restarted; 0 = never
    allow_remote: bool = False  # a tcp:// endpoint beyond loopback must be asked for
    curve_secret_key: str = ""  # the daemon's secret certificate file: clients must speak CurveZMQ
    curve_clients_dir: str = ""  # public certificates of the only clients let in (needs the above)
    progress_interval_s: float = PROGRESS_INTERVAL_S  # 0 = no progress lines (--quiet)
    http_address: tuple[str, int] | None = None  # (host, port) of the OpenAI-compatible HTTP server; None = off
    http_processes: int = 0  # HTTP server processes on that port; 0 = default_http_processes()
    api_key: str = ""  # HTTP callers must send `Authorization: Bearer <api_key>`; "" = no key
    api_keys_file: str = ""  # named keys, their tenants' weights and limits (cbatch/api_keys.py); "" = none
    state_dir: str = ""  # with http_address: the uploaded files and batch jobs (cbatch.jobs), kept across restarts
    # Ended batch jobs and their output files are removed this long after they ended; 0 = kept.
    batch_retention_s: float = 30 * 24 * 3600.0
    # A running batch job gives its place to a waiting tenant's after this long (cbatch.jobs.job_runner).
    batch_job_slice_s: float = 60.0
    # More names the model answers to (HTTP `model`, OpenAI batch files), beside its file's name.
    aliases: tuple[str, ...] = ()
    # Timeouts of requests that give none, by priority: seconds from arrival; 0 = none.
    interactive_timeout_s: float = 0.0
    batch_timeout_s: float = 0.0

    def deadline_s(self, timeout_s: float, is_batch: bool, now_s: float) -> float:
        """A request's deadline on the monotonic clock: its own timeout, else the default
        for its priority; 0 = none."""
        timeout_s = timeout_s or (self.batch_timeout_s if is_batch else self.interactive_timeout_s)
        return now_s + timeout_s if timeout_s else 0.0

    def __post_init__(self):
        if not self.endpoint:
            object.__setattr__(self, "endpoint", default_endpoint())
        self._check_endpoint()
        if self.http_address is not None:
            self._check_http(*self.http_address)
        if not 0 <= self.http_processes <= MAX_HTTP_PROCESSES:
            raise CbatchError(INVALID_CONFIG, f"--http-processes must be in [0, {MAX_HTTP_PROCESSES}], "
                                              f"got {self.http_processes}")
        if not self.http_processes:
            object.__setattr__(self, "http_processes", default_http_processes())
        self._check_curve_and_aliases()
        capacity = self.ring_capacity
        if capacity < 8 or capacity & (capacity - 1):
            raise CbatchError(INVALID_CONFIG, f"--ring-capacity must be a power of two >= 8, got {capacity}")
        self._check_times()

    def _check_endpoint(self) -> None:
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise CbatchError(INVALID_CONFIG,
                              f"--endpoint must be ipc://PATH or tcp://HOST:PORT, got {self.endpoint!r}")
        if self.endpoint.startswith("ipc://") and len(self.endpoint[len("ipc://"):].encode()) > MAX_IPC_PATH_BYTES:
            raise CbatchError(INVALID_CONFIG, f"--endpoint path is longer than {MAX_IPC_PATH_BYTES} bytes, the "
                                              "limit of a Unix socket path; use a shorter one")
        host = self.endpoint[len("tcp://"):].rsplit(":", 1)[0] if self.endpoint.startswith("tcp://") else ""
        if host and not _is_loopback(host) and not self.allow_remote:
            raise CbatchError(INVALID_CONFIG, f"--endpoint {self.endpoint} listens beyond this machine; pass "
                                              "--allow-remote (and --curve-secret-key to require CurveZMQ)")

    def _check_http(self, http_host: str, http_port: int) -> None:
        if not 0 < http_port < 65536:
            raise CbatchError(INVALID_CONFIG, f"--http port must be in [1, 65535], got {http_port}")
        if not _is_loopback(http_host) and not self.allow_remote:
            raise CbatchError(INVALID_CONFIG, f"--http {http_host}:{http_port} listens beyond this machine; pass "
                                              "--allow-remote")
        if not _is_loopback(http_host) and not (self.api_key or self.api_keys_file):
            raise CbatchError(INVALID_CONFIG, f"--http {http_host}:{http_port} listens beyond this machine, so it "
                                              "needs a key: pass --api-key KEY, --api-key-file PATH or "
                                              "--api-keys-file PATH")
        if self.curve_secret_key:  # the HTTP server is a client of the daemon and holds no certificate
            raise CbatchError(INVALID_CONFIG, "--http cannot be combined with --curve-secret-key")

    def _check_curve_and_aliases(self) -> None:
        if self.curve_clients_dir and not self.curve_secret_key:
            raise CbatchError(INVALID_CONFIG, "--curve-clients needs --curve-secret-key")
        for path in (self.curve_secret_key, self.curve_clients_dir):
            if path and not os.path.exists(path):
                raise CbatchError(INVALID_CONFIG, f"{path} does not exist")
        for alias in self.aliases:
            if not alias.strip() or len(alias) > MAX_ALIAS_CHARS:
                raise CbatchError(INVALID_CONFIG, f"--alias must be a non-blank name of at most {MAX_ALIAS_CHARS} "
                                                  f"characters, got {alias!r}")
        if len(set(self.aliases)) != len(self.aliases):
            raise CbatchError(INVALID_CONFIG, "--alias names a model name twice")

    def _check_times(self) -> None:
        for flag, value in (("--worker-timeout", self.worker_timeout_s), ("--drain-grace", self.drain_grace_s),
                            ("--progress-interval", self.progress_interval_s), ("--retention", self.retention_s),
                            ("--reconnect-grace", self.reconnect_grace_s)):
            if value < 0:
                raise CbatchError(INVALID_CONFIG, f"{flag} must be >= 0, got {value}")
        for flag, value in (("--interactive-timeout", self.interactive_timeout_s),
                            ("--batch-timeout", self.batch_timeout_s)):
            if not 0 <= value <= MAX_TIMEOUT_S:
                raise CbatchError(INVALID_CONFIG, f"{flag} must be in [0, {MAX_TIMEOUT_S:g}] seconds, got {value:g}")
        if self.batch_job_slice_s <= 0:
            raise CbatchError(INVALID_CONFIG, f"--batch-job-slice must be > 0, got {self.batch_job_slice_s}")
