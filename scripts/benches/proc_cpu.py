"""CPU seconds of a server's processes and threads, read from /proc, for the benchmarks'
per-token cost columns. A cbatch daemon is split into its front-end (the supervisor
process), its HTTP processes, and its decode worker's main thread (the engine loop, which
also computes its share of every llama_decode) and other threads (llama.cpp's other compute
threads, the I/O and preparer threads)."""

import os

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat_cpu_s(path: str) -> float:
    """utime + stime of a /proc stat file; 0 once the process or thread is gone."""
    try:
        with open(path) as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(child) for child in children.read().split()]
    except FileNotFoundError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read()
    except FileNotFoundError:
        return b""


def cbatch_cpu_s(daemon_pid: int) -> dict[str, float]:
    """CPU seconds so far of each part of a cbatch daemon (see the module docstring)."""
    parts = {"front-end": _stat_cpu_s(f"/proc/{daemon_pid}/stat"), "HTTP processes": 0.0,
             "worker main thread": 0.0, "worker other threads": 0.0}
    for child in _children(daemon_pid):
        cmdline = _cmdline(child)
        if b"cbatch.http_api" in cmdline:
            parts["HTTP processes"] += _stat_cpu_s(f"/proc/{child}/stat")
        elif b"spawn_main" in cmdline:
            for tid in os.listdir(f"/proc/{child}/task"):
                part = "worker main thread" if int(tid) == child else "worker other threads"
                parts[part] += _stat_cpu_s(f"/proc/{child}/task/{tid}/stat")
    return parts


def process_cpu_s(pid: int) -> float:
    """CPU seconds so far of one process (all its threads)."""
    return _stat_cpu_s(f"/proc/{pid}/stat")


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}
