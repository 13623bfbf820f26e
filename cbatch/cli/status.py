"""cbatch-status: what a running daemon is doing (health, the stats, one row per running request)."""

import argparse
import json
import sys

from cbatch.cli.common import add_version
from cbatch.errors import UNAVAILABLE, CbatchError
from cbatch.wording import counted

EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE = 0, 1, 3
SLOT_COLUMNS = ("slot", "request", "state", "prompt", "tokens", "age")
STARVED_CPU_SHARE = 0.6  # below this share of their cores the compute threads wait for the CPU more than they compute


def job_lines(jobs: dict) -> list[str]:
    """One line per batch job not ended (the daemon's state directory), oldest first; first
    a line saying so when the job runner is down."""
    lines = []
    runner = jobs.get("runner")
    if runner is not None and not runner["is_running"]:
        lines.append(f"batch jobs wait: the job runner is down, restarting (it exited "
                     f"{counted(runner['num_quick_deaths'], 'time')} in a row just after its start; "
                     "the daemon's log says why)")
    for job in jobs["active"]:
        if job["status"] == "validating":  # its lines are not counted yet
            lines.append(f"batch {job['id']} validating: waiting for the job runner")
            continue
        done = job["completed"] + job["failed"]
        eta = "" if job["eta_s"] is None else f", ETA {job['eta_s']:.0f} s"
        lines.append(f"batch {job['id']} {job['status']}: {done}/{job['total']} lines done ({job['failed']} failed), "
                     f"{job['lines_per_s']:.1f} lines/s, {job['tokens_per_s']:.1f} tok/s, "
                     f"{job['prompt_tokens']} prompt + {job['generated_tokens']} generated tokens{eta}")
    num_not_shown = jobs["num_active"] - len(jobs["active"])
    if num_not_shown > 0:
        lines.append(f"and {counted(num_not_shown, 'batch job')} more waiting")
    return lines


def cache_tier_lines(stats: dict) -> list[str]:
    """The host-memory and disk tiers below the slots, when on."""
    if "host_cache_bytes" not in stats:
        return []
    lines = [f"host cache: {stats['host_cache_bytes'] / 2**20:.0f} of {stats['host_cache_max_bytes'] / 2**20:.0f} MiB, "
             f"{stats['host_cache_entries']} saved prefixes; "
             f"{counted(stats['host_cache_hits'], 'hit')}, {counted(stats['host_cache_saved'], 'state')} saved, "
             f"{counted(stats['host_cache_evictions'], 'eviction')}"]
    if "disk_cache_bytes" in stats:
        lines.append(f"disk cache: {stats['disk_cache_bytes'] / 1e9:.2f} of {stats['disk_cache_max_bytes'] / 1e9:.1f} "
                     f"GB in {counted(stats['disk_cache_files'], 'file')}; {counted(stats['disk_cache_hits'], 'hit')}, "
                     f"{stats['disk_cache_written']} written, {stats['disk_cache_skipped']} skipped")
    return lines


def format_status(endpoint: str, health: dict, stats: dict) -> str:
    if health["status"] == "starting":  # the model, the worker and the context are not known yet
        about = (f"starting: the decode worker is loading the model; parallel {stats['parallel']}; "
                 f"{counted(stats.get('num_in_flight', 0), 'request')} waiting for it")
        return f"cbatch-worker at {endpoint}: {about}"
    lines = [
        f"cbatch-worker at {endpoint}: {health['status']}, model {health['model']}, worker pid {health['worker_pid']}",
        f"parallel {stats['parallel']}, context {health['ctx_per_seq']} per sequence; "
        f"{stats['num_active']} active ({stats.get('num_paused', 0)} paused), {stats['num_queued']} queued, "
        f"{stats.get('num_parked', 0)} parked for slow readers, "
        f"{counted(stats.get('num_in_flight', 0), 'request')} in flight, "
        f"{counted(stats['num_requests_ended'], 'request')} ended, "
        f"{counted(stats.get('num_preemptions', 0), 'preemption')}",
        f"decode {stats.get('decode_tokens_per_s', 0.0):.1f} tok/s, "
        f"prefill {stats.get('prefill_tokens_per_s', 0.0):.1f} tok/s, "
        f"{stats.get('avg_concurrent_seqs', 0.0):.1f} sequences per decode step on average",
    ]
    lines += busy_host_lines(stats)
    if "kv_cells_total" in stats:  # the worker has reported once
        lines.append(
            f"prefix cache {'on' if stats['prefix_cache'] else 'off'}: hit rate {100 * stats['cache_hit_rate']:.0f}%, "
            f"{counted(stats['prompt_tokens_reused'], 'prompt token')} reused; KV cells {stats['kv_cells_used']} of "
            f"{stats['kv_cells_total']} used, {stats['kv_cells_evictable']} evictable")
        lines += cache_tier_lines(stats)
    lines += [f"tenant {tenant}: {usage['num_in_flight']} in flight, {counted(usage['num_requests'], 'request')} "
              f"finished, {usage['num_prompt_tokens']} prompt + {usage['num_generated_tokens']} generated tokens"
              for tenant, usage in (stats.get("tenants") or {}).items()]
    if stats.get("jobs"):
        lines += job_lines(stats["jobs"])
    lines += slot_lines(stats.get("slots", []))
    return "\n".join(lines)


def busy_host_lines(stats: dict) -> list[str]:
    """What a busy host costs the decode, when it costs anything."""
    lines = []
    num_threads, max_threads = stats.get("compute_threads", 0), stats.get("compute_threads_max", 0)
    if num_threads < max_threads:
        lines.append(f"busy host: decoding with {num_threads} compute thread(s) instead of {max_threads} while other "
                     "processes take the cores (the default --threads adapts; set --threads to fix a count)")
    share = stats.get("compute_cpu_share", 1.0)
    if share < STARVED_CPU_SHARE:
        lines.append(f"slow steps: llama.cpp's compute threads got {100 * share:.0f}% of their cores while decoding "
                     "(other processes use them): give the daemon fewer --threads, or the host fewer other jobs")
    return lines


def slot_lines(slots: list[dict]) -> list[str]:
    """The running requests, a table row each."""
    if not slots:
        return ["no request running"]
    rows = [SLOT_COLUMNS] + [(
        str(slot["seq_id"]), str(slot["request_id"]), slot["state"],
        f"{slot['prompt_tokens_done']}/{slot['prompt_tokens']}", str(slot["tokens"]), f"{slot['age_s']:.1f} s",
    ) for slot in slots]
    widths = [max(len(row[i]) for row in rows) for i in range(len(SLOT_COLUMNS))]
    return ["  ".join(cell.rjust(width) if i != 2 else cell.ljust(width) for i, (cell, width) in
                      enumerate(zip(row, widths))).rstrip() for row in rows]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="cbatch-status", description="Show what a cbatch-worker daemon is doing.")
    parser.add_argument("--endpoint", default=None,
                        help="daemon endpoint (default: CBATCH_ENDPOINT or the local ipc socket)")
    parser.add_argument("--json", action="store_true", help="print {\"health\": ..., \"stats\": ...} as JSON")
    parser.add_argument("--curve-server-key",
                        help="the daemon's CurveZMQ public certificate (or CBATCH_CURVE_SERVER_KEY)")
    parser.add_argument("--curve-client-key",
                        help="this client's CurveZMQ secret certificate (or CBATCH_CURVE_CLIENT_KEY)")
    add_version(parser)
    args = parser.parse_args(argv)
    from cbatch.client import Client

    try:
        with Client(args.endpoint, use_ring=False, curve_server_key=args.curve_server_key,
                    curve_client_key=args.curve_client_key) as client:
            health, stats = client.health(), client.stats()
            endpoint = client.endpoint
    except CbatchError as err:
        print(f"cbatch-status: {err.message}", file=sys.stderr)
        sys.exit(EXIT_UNREACHABLE if err.code == UNAVAILABLE else EXIT_FAILED)
    for reply in (health, stats):
        reply.pop("nonce", None)
    health.pop("lost_request_ids", None)
    if args.json:
        print(json.dumps({"health": health, "stats": stats}))
    else:
        print(format_status(endpoint, health, stats))
    sys.exit(EXIT_OK)
