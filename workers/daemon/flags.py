"""cbatch-worker's flags, and the daemon's configuration they make (workers/daemon/main.py runs it)."""

import argparse
import logging
import os

from cbatch.api_keys import load_keys
from cbatch.cli.common import add_version
from cbatch.config import MAX_PARALLEL, POOLING_NAMES, DaemonConfig, EngineConfig, default_endpoint, parse_http_address
from cbatch.errors import INVALID_CONFIG, CbatchError

ENGINE = EngineConfig()  # the defaults the flags show
DAEMON = DaemonConfig(ENGINE, endpoint="ipc://unused")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbatch-worker", description="Serve one GGUF model to many clients.")
    add_version(parser)
    add = parser.add_argument

    def switch(flag: str, help_text: str) -> None:
        """An engine setting that is on or off (--NAME / --no-NAME), its default the engine's."""
        add(flag, action=argparse.BooleanOptionalAction, default=getattr(ENGINE, flag[2:].replace("-", "_")),
            help=help_text)

    add("-m", "--model", help="GGUF file (default: the embedded gemma-3-270m)")
    add("-np", "--parallel", type=int, default=ENGINE.parallel,
        help=f"sequences decoded together, 1 to {MAX_PARALLEL} (default {ENGINE.parallel})")
    add("-c", "--ctx-size", type=int, default=ENGINE.ctx_size,
        help="total context for all sequences (default 4096 each)")
    add("-b", "--batch-size", type=int, default=ENGINE.batch_size,
        help=f"tokens per decode step (default {ENGINE.batch_size})")
    add("-t", "--threads", type=int, default=ENGINE.threads,
        help="CPU threads (default: the CPUs this daemon may run on, from its affinity mask)")
    add("-ngl", "--n-gpu-layers", type=int, default=None,
        help="layers to offload to a GPU (default -1: all of them on a GPU build)")
    add("--interactive-timeout", type=float, default=0.0, metavar="S",
        help="seconds an interactive request that sets no timeout may take, queued and running (default 0: no limit)")
    add("--batch-timeout", type=float, default=0.0, metavar="S",
        help="seconds a batch-priority request that sets no timeout may take (default 0: no limit)")
    add("--alias", action="append", default=[], metavar="NAME",
        help="another name the model answers to over HTTP and in batch files, beside its file's name (repeatable)")
    add("--max-queue", type=int, default=ENGINE.max_queue, metavar="N",
        help=f"interactive requests waiting beyond --parallel; more get queue_full (default {ENGINE.max_queue})")
    add("--max-batch-queue", type=int, default=None, metavar="N",
        help="batch-priority requests waiting beyond --parallel, a room of their own: a batch load never fills "
             "--max-queue (default: as --max-queue)")
    switch("--kv-unified", "one KV pool shared by all sequences, or one stream per sequence (default)")
    switch("--prefix-cache", "reuse the KV of cached prompt prefixes (default on)")
    switch("--preempt-batch", "an interactive request that finds every slot taken preempts a running "
                              "batch-priority one, which resumes later with the same output (default on)")
    add("--park-after", type=float, default=ENGINE.park_after_s, metavar="S",
        help="a request paused this long in all for a client that reads slower than it generates gives its slot "
             "to waiting requests, its KV kept, and resumes once the client catches up (default "
             f"{ENGINE.park_after_s:g})")
    switch("--fair-share", "within a priority, admit requests to free slots by their tenants' (API key names) "
                           "tokens served per weight; off, requests are admitted in arrival order, however many a "
                           "tenant sends (default on)")
    add("--pooling", choices=POOLING_NAMES, default=ENGINE.pooling,
        help=f"embedding pooling for a model whose GGUF declares none, a causal LM (default {ENGINE.pooling})")
    add("--cache-tokens", type=int, default=ENGINE.cache_tokens,
        help="unified pool: KV cells kept for finished requests' prefixes (default: one sequence's context)")
    add("--cache-ram", type=int, default=ENGINE.cache_ram_mib, metavar="MiB",
        help="host memory for saved KV states of prefixes the slots gave up, so conversations beyond --parallel "
             "come back at the cost of their new tokens (default: 8192, at most a quarter of the memory available at "
             "start; 0 = off)")
    add("--cache-dir", default=ENGINE.cache_dir, metavar="DIR",
        help="also keep saved KV states in this directory, across restarts (default: off)")
    add("--cache-dir-max-gb", type=float, default=ENGINE.cache_dir_max_gb, metavar="GB",
        help=f"the most --cache-dir holds, least recently used out first (default {ENGINE.cache_dir_max_gb:g})")
    add("--keep-billing-header", action="store_true",
        help="leave Claude Code's per-request 'x-anthropic-billing-header: ...' line in chats' system prompts; by "
             "default it is removed, as it differs on every request and no two turns would share a cached prefix")
    switch("--backend-sampling", "sample inside llama.cpp's graph when a request allows (default: on a GPU build only)")
    switch("--overlap", "decode step N+1 while step N's text is made and published (default: on when layers "
                        "are offloaded to a GPU, off on a CPU)")
    add("--reasoning", choices=("auto", "off"), default=ENGINE.reasoning,
        help="split a thinking model's <think>...</think> into reasoning_content over HTTP: auto (default: when the "
             "chat template mentions <think>, or --reasoning-tags is given) or off")
    add("--reasoning-tags", nargs=2, default=None, metavar=("OPEN", "CLOSE"),
        help="the tags the model thinks in, when its chat template does not tell (e.g. '<think>' '</think>')")
    add("--mmproj", default=None, metavar="GGUF",
        help="the model's vision projector (an mmproj GGUF, as llama.cpp's): chat messages may then carry images")
    add("--max-images", type=int, default=ENGINE.max_images, metavar="N",
        help=f"images one request may carry (default {ENGINE.max_images})")
    add("--max-image-bytes", type=int, default=ENGINE.max_image_bytes, metavar="N",
        help=f"bytes of one image file (default and most {ENGINE.max_image_bytes})")
    add("--max-image-pixels", type=int, default=ENGINE.max_image_pixels, metavar="N",
        help=f"pixels of one image, width x height (default {ENGINE.max_image_pixels})")
    add("--endpoint", default="", help="ipc://PATH or tcp://HOST:PORT (default: CBATCH_ENDPOINT or an ipc socket)")
    add("--ring-capacity", type=int, default=DAEMON.ring_capacity, help="token ring records (power of two)")
    add("--drain-grace", type=float, default=DAEMON.drain_grace_s, help="seconds in-flight requests get on SIGTERM")
    add("--retention", type=float, default=DAEMON.retention_s,
        help=f"seconds a finished request's tokens stay fetchable by a reader the ring lapped "
             f"(default {DAEMON.retention_s:g})")
    add("--reconnect-grace", type=float, default=DAEMON.reconnect_grace_s,
        help=f"seconds a client whose connection died keeps its requests, to come back and get what they produced "
             f"(default {DAEMON.reconnect_grace_s:g}; 0 = cancel them at once)")
    add("--worker-timeout", type=float, default=DAEMON.worker_timeout_s,
        help="seconds without a step before the decode worker is restarted (0 = never)")
    add("--progress-interval", type=float, default=DAEMON.progress_interval_s,
        help=f"seconds between progress lines in the log while requests are in flight "
             f"(default {DAEMON.progress_interval_s:g})")
    add("-q", "--quiet", action="store_true", help="no progress lines")
    add("--allow-remote", action="store_true", help="allow a tcp:// endpoint beyond loopback")
    add("--curve-secret-key", default="", help="daemon's CurveZMQ secret certificate: require CurveZMQ")
    add("--curve-clients", default="", help="directory of client public certificates allowed in")
    add("--http", default="", metavar="[HOST:]PORT",
        help="also serve the OpenAI-compatible HTTP API (default host 127.0.0.1)")
    add("--api-key", default="", metavar="KEY",
        help="HTTP callers must send 'Authorization: Bearer KEY' (needed when --http listens beyond loopback)")
    add("--api-key-file", default="", metavar="PATH", help="read the --api-key from this file (kept out of ps)")
    add("--api-keys-file", default="", metavar="PATH",
        help="named keys, one a line: 'NAME KEY [weight=W] [max_concurrent=N] [tokens_per_min=N] [metrics=1]'; NAME "
             "is the tenant its requests run as (fair share by weight, limits per key); only a key with metrics=1 "
             "reads /metrics; read again on SIGHUP")
    add("--state-dir", default="", metavar="DIR",
        help="with --http: where uploaded files and batch jobs (/v1/files, /v1/batches) are kept, across restarts "
             "(default one per endpoint under $XDG_STATE_HOME/cbatch or ~/.local/state/cbatch); a directory "
             "another running daemon uses, or one made for another model, is refused")
    add("--batch-retention-days", type=float, default=DAEMON.batch_retention_s / 86400, metavar="DAYS",
        help="ended batch jobs and their output and error files are removed this many days after they ended "
             f"(default {DAEMON.batch_retention_s / 86400:g}; 0 keeps them); uploaded files stay until deleted")
    add("--batch-job-slice", type=float, default=DAEMON.batch_job_slice_s, metavar="SECONDS",
        help="batch jobs run one per tenant, up to 8 at once; past that a job that ran this long gives its place to "
             "a waiting tenant's and goes on later from its finished lines "
             f"(default {DAEMON.batch_job_slice_s:g})")
    add("--http-processes", type=int, default=0, metavar="N",
        help="HTTP server processes sharing the --http port (default: one per 8 CPUs this daemon may use, 1 to 4)")
    return parser


def _api_key(args) -> str:
    if args.api_keys_file and (args.api_key or args.api_key_file):
        raise CbatchError(INVALID_CONFIG, "give --api-keys-file or --api-key (--api-key-file), not both: a single "
                                          "key is a line of the keys file")
    if args.api_keys_file:
        load_keys(args.api_keys_file)  # a bad line stops the start, naming the line
    if not args.api_key_file:
        return args.api_key
    try:
        with open(args.api_key_file) as key_file:
            return key_file.read().strip()
    except OSError as err:
        raise CbatchError(INVALID_CONFIG, f"cannot read --api-key-file {args.api_key_file}: {err.strerror}") from None


def _state_dir(args, endpoint: str) -> str:
    """The state directory, checked now when HTTP is served: a daemon that could not keep
    the batches it accepts, or whose directory is another daemon's, fails at its start instead."""
    if not args.http:
        return ""
    from cbatch.jobs.state_dir import check_state_dir, claim_state_dir, default_state_dir
    from cbatch.model import resolve_model_path

    model_path = resolve_model_path(args.model)
    path = check_state_dir(args.state_dir or default_state_dir(endpoint, model_path))
    claim_state_dir(path, model_path)
    return path


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    """Raises CbatchError(INVALID_CONFIG) naming the flag to change."""
    engine = EngineConfig(model_path=args.model, parallel=args.parallel, ctx_size=args.ctx_size,
                          batch_size=args.batch_size, threads=args.threads,
                          n_gpu_layers=ENGINE.n_gpu_layers if args.n_gpu_layers is None else args.n_gpu_layers,
                          max_queue=args.max_queue, max_batch_queue=args.max_batch_queue,
                          kv_unified=args.kv_unified, prefix_cache=args.prefix_cache, preempt_batch=args.preempt_batch,
                          fair_share=args.fair_share, park_after_s=args.park_after,
                          cache_tokens=args.cache_tokens, cache_ram_mib=args.cache_ram,
                          cache_dir=os.path.abspath(args.cache_dir) if args.cache_dir else "",
                          cache_dir_max_gb=args.cache_dir_max_gb, keep_billing_header=args.keep_billing_header,
                          backend_sampling=args.backend_sampling,
                          overlap=args.overlap, pooling=args.pooling, reasoning=args.reasoning,
                          reasoning_tags=tuple(args.reasoning_tags) if args.reasoning_tags else None,
                          mmproj_path=os.path.abspath(args.mmproj) if args.mmproj else None,
                          max_images=args.max_images, max_image_bytes=args.max_image_bytes,
                          max_image_pixels=args.max_image_pixels)
    return DaemonConfig(engine, endpoint=args.endpoint, ring_capacity=args.ring_capacity,
                        drain_grace_s=args.drain_grace, retention_s=args.retention,
                        reconnect_grace_s=args.reconnect_grace, worker_timeout_s=args.worker_timeout,
                        allow_remote=args.allow_remote,
                        progress_interval_s=0.0 if args.quiet else args.progress_interval,
                        curve_secret_key=args.curve_secret_key, curve_clients_dir=args.curve_clients,
                        http_address=parse_http_address(args.http) if args.http else None,
                        http_processes=args.http_processes, api_key=_api_key(args), aliases=tuple(args.alias),
                        state_dir=_state_dir(args, args.endpoint or default_endpoint()),
                        api_keys_file=args.api_keys_file, batch_retention_s=args.batch_retention_days * 86400,
                        batch_job_slice_s=args.batch_job_slice,
                        interactive_timeout_s=args.interactive_timeout, batch_timeout_s=args.batch_timeout)


def warn_if_no_gpu(args: argparse.Namespace) -> None:
    """-ngl asks for GPU layers; a CPU build of llama.cpp runs every layer on the CPU all
    the same, which the caller should hear rather than find out from the speed."""
    if args.n_gpu_layers is None or args.n_gpu_layers == 0:
        return
    import llama_cpp

    if not llama_cpp.llama_supports_gpu_offload():
        logging.getLogger("cbatch.daemon").warning(
            "cbatch-worker: warning: -ngl %d has no effect: this llama.cpp build has no GPU support, so every "
            "layer runs on the CPU", args.n_gpu_layers)
