"""cbatch's benchmarks, one entry: `scripts/bench.py NAME [OPTIONS]` runs scripts/benches/NAME.py
(`scripts/bench.py` alone lists them, `scripts/bench.py NAME --help` tells one's options).

Every run says, on stderr, the commit it measured (and whether the tree had changes), the
machine (CPU model, cores, memory, accelerator) and, when it ends, its wall time and the
CPU this process (the in-process callers) and its reaped children (daemons, llama-server,
load generators) used. A bench prints its figures as tables and its other findings as
notes (benches/report.py); `--json FILE`, before NAME, appends all of that as one JSON
line, with the run's command, its exit status, its tables (rows of numbers under their
column names), notes and printed text, so runs on different machines and commits sit side
by side in one file. The entry exits with the bench's status (a bench's `main` returns
nonzero when a check it makes failed).

    .venv/bin/python scripts/bench.py request_path
    .venv/bin/python scripts/bench.py --json runs.jsonl serving --model /tmp/tiny.gguf --parallel 16
"""

import contextlib
import datetime
import importlib
import io
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from benches import report  # scripts/benches/, beside this file

BENCHES = Path(__file__).resolve().parent / "benches"
# What the benches share (benches/__init__.py), not benches themselves.
HELPERS = frozenset({"__init__", "callers", "loadgen", "options", "peers", "proc_cpu", "report", "schema_suite"})


def bench_names() -> list[str]:
    return sorted(path.stem for path in BENCHES.glob("*.py") if path.stem not in HELPERS)


def _summary(name: str, max_chars: int = 100) -> str:
    """A bench's docstring's first sentence, cut to max_chars, read without importing the
    bench (its imports are heavy)."""
    text = (BENCHES / f"{name}.py").read_text()
    doc = text.split('"""', 2)[1] if text.startswith('"""') else ""
    sentence = " ".join(re.split(r"[.:]\s", doc, maxsplit=1)[0].split())
    return sentence if len(sentence) <= max_chars else sentence[:max_chars - 3].rsplit(" ", 1)[0] + "..."


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=BENCHES, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def machine() -> dict:
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
    memory_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal"))
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.split("\n") if _has("nvidia-smi") else []
    return {"cpu": cpu_model, "cores": os.cpu_count(), "memory_gib": round(memory_kib / 2**20, 1),
            "accelerators": [gpu for gpu in gpus if gpu], "python": platform.python_version()}


def _has(command: str) -> bool:
    return any((Path(folder) / command).exists() for folder in os.environ.get("PATH", "").split(os.pathsep))


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class _Tee(io.TextIOBase):
    """The bench's printed figures, to the terminal and kept for the JSON line."""

    def __init__(self, terminal):
        self.terminal, self.kept = terminal, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.terminal.write(text)

    def flush(self) -> None:
        self.terminal.flush()


def run(name: str, argv: list[str], json_path: str | None) -> int:
    """Run one bench; its exit status (a bench whose `main` returns nonzero failed a check)."""
    commit = _git("rev-parse", "--short=12", "HEAD")
    record = {"bench": name, "argv": argv, "commit": commit, "is_dirty": bool(_git("status", "--porcelain")),
              "machine": machine(), "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    print(f"# bench {name} at {commit}{' (changed)' if record['is_dirty'] else ''} on {record['machine']['cpu']}, "
          f"{record['machine']['cores']} cores, {record['machine']['memory_gib']} GiB"
          + "".join(f", {gpu}" for gpu in record["machine"]["accelerators"]), file=sys.stderr, flush=True)
    module = importlib.import_module(f"benches.{name}")
    sys.argv = [f"{Path(sys.argv[0]).name} {name}", *argv]  # each bench's own parser reads its options
    started_s, self_cpu_s, children_cpu_s = time.perf_counter(), _cpu_s(resource.RUSAGE_SELF), \
        _cpu_s(resource.RUSAGE_CHILDREN)
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        status = module.main()
    record.update(wall_s=round(time.perf_counter() - started_s, 3),
                  cpu_self_s=round(_cpu_s(resource.RUSAGE_SELF) - self_cpu_s, 3),
                  cpu_children_s=round(_cpu_s(resource.RUSAGE_CHILDREN) - children_cpu_s, 3),
                  status=status or 0, **report.kept(), output=tee.kept.getvalue().splitlines())
    print(f"# bench {name}: {record['wall_s']:.1f} s; CPU {record['cpu_self_s']:.1f} s in this process (its "
          f"callers), {record['cpu_children_s']:.1f} s in its reaped children", file=sys.stderr, flush=True)
    if json_path:
        with open(json_path, "a") as out:
            out.write(json.dumps(record) + "\n")
    return status or 0


def main() -> None:
    args = sys.argv[1:]
    json_path = None
    if args[:1] == ["--json"] and len(args) >= 2:
        json_path, args = args[1], args[2:]
    names = bench_names()
    if not args or args[0] in ("-h", "--help", "list"):
        print(__doc__.split("\n\n")[0] + "\n")
        for name in names:
            print(f"  {name:16} {_summary(name)}")
        return
    if args[0] not in names:
        sys.exit(f"bench.py: no bench named {args[0]!r}; the benches: {', '.join(names)}")
    sys.exit(run(args[0], args[1:], json_path))


if __name__ == "__main__":
    main()
