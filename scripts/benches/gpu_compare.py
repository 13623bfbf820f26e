"""cbatch beside llama-server on a GPU, as one run that stops by itself inside a time budget.

Stages, in order, each given what is left of --budget-s and skipped with a note when too little is:

    versions   nvidia-smi, nvcc, the llama.cpp commit vendored in the pinned sdist, cbatch's commit
    build      llama-server and llama-cpp-python from the same vendored llama.cpp, CUDA for this
               GPU's architecture only (read from nvidia-smi), Release, ninja (full mode only)
    model      the gemma-3-270m chunks in --stage-dir joined into one GGUF (or --model)
    gpu-tests  the suite's tests marked `gpu` (skipped with a note while none is marked)
    serving    scripts/bench.py serving at each --parallel: whole and streamed HTTP, the ZeroMQ
               batch, light callers; tok/s, TTFT p50, host ms per step, llama-server beside it
    host-work  scripts/bench.py host_work: host ms per decode step, by phase
    long       scripts/bench.py long_prompts: long prompts admitted among decoding ones

Modes: `full` (a fresh device machine: every stage), `compare` (a warm machine that ran `full`:
the measuring stages only), `rehearse` (no GPU: no build, this .venv's llama-cpp-python, small
sizes, so that every stage's code path runs on a CPU). Each stage's output goes to
$OUT/<stage>.log (OUT defaults to results/gpu-compare), and a bench's run, through
`scripts/bench.py --json`, to $OUT/<stage>.jsonl, whose tables the stage's figures are read
from. At the end a table of the stages (status, seconds, their main figures) is printed and
written to $OUT/table.txt, and the versions with every stage's status, figures, tables and
notes to $OUT/summary.json. While it runs, a line per stage goes to stderr as the stage ends.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benches.options import bench_parser
from benches.report import Table, cell, note

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
# The least time a stage is started with: below it the stage is skipped with a note.
MIN_STAGE_S = {"build": 240, "serving": 60, "host-work": 20, "long": 40, "gpu-tests": 20}


def sh(command: str, timeout_s: float, log: Path) -> tuple[int, str]:
    """Run a shell command with its output in `log`; 124 when it ran past `timeout_s`."""
    try:
        done = subprocess.run(command, shell=True, cwd=REPO, capture_output=True, text=True,
                              timeout=max(timeout_s, 1))
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, text = 124, (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
    log.write_text(f"$ {command}\n{text}")
    return code, text


def last_line(text: str) -> tuple[str, dict]:
    """A stage that is not a bench: its output's last line (pytest's count, the build's last
    step), and nothing besides for summary.json."""
    lines = text.strip().splitlines()
    return (lines[-1][:200] if lines else ""), {}


class Run:
    def __init__(self, args):
        self.args, self.started = args, time.monotonic()
        self.out = Path(os.environ.get("OUT") or REPO / "results" / "gpu-compare")
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows: list[tuple[str, str, float, str]] = []  # stage, status, seconds, figures
        self.summary: dict = {"mode": args.mode, "versions": {}, "stages": {}}

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def stage(self, name: str, command: str, figures=last_line) -> bool:
        """Run one stage's command inside what is left of the budget, `figures` reading what
        it found from its output (a line for the table, and what summary.json keeps besides);
        whether it ran and passed."""
        if self.left_s() < MIN_STAGE_S.get(name.split()[0], 10):
            self.add(name, "skipped", 0, f"{self.left_s():.0f} s left of the budget")
            return False
        start = time.monotonic()
        log = self.out / f"{name.replace(' ', '-')}.log"
        code, text = sh(command, self.left_s(), log)
        seconds = time.monotonic() - start
        if code != 0:
            self.add(name, "out of time" if code == 124 else f"failed ({code})", seconds, " ".join(text.split())[-200:])
            return False
        try:
            line, kept = figures(text)
        except Exception as exc:  # this runs once, unwatched: a figure it cannot read must not stop the stages after
            line, kept = f"figures unreadable ({exc!r}); see {log.name}", {}
        self.add(name, "ok", seconds, line, kept)
        return True

    def bench(self, name: str, arguments: str, summarize) -> None:
        """Run `scripts/bench.py NAME ...` as a stage, its run written as a JSON line to
        $OUT/<stage>.jsonl; `summarize` makes the table's line from that run's tables."""
        runs = self.out / f"{name.replace(' ', '-')}.jsonl"
        runs.unlink(missing_ok=True)  # the entry appends: a line an earlier run left here is not this run's

        def figures(_text: str) -> tuple[str, dict]:
            record = json.loads(runs.read_text().splitlines()[-1])
            return summarize(record), {"tables": record["tables"], "notes": record["notes"]}

        self.stage(name, f"{PYTHON} scripts/bench.py --json {runs} {arguments}", figures)

    def add(self, name: str, status: str, seconds: float, figures: str, kept: dict | None = None) -> None:
        self.rows.append((name, status, seconds, figures))
        self.summary["stages"][name] = {"status": status, "s": round(seconds, 1), "figures": figures, **(kept or {})}
        print(f"[{time.monotonic() - self.started:5.0f} s] {name}: {status}", file=sys.stderr, flush=True)

    def finish(self) -> int:
        """Print and write the table of the stages; 1 when a stage failed or ran out of time
        (a skipped one is no failure: the budget said so), which the entry exits with."""
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # kept as printed for table.txt, then shown
            stages = Table("stages", "stage", "status", "s", "figures", widths={"stage": 18, "status": 12})
            for name, status, seconds, figures in self.rows:
                stages.row(name, status, round(seconds), figures)
            note(f"total {time.monotonic() - self.started:.0f} s of a {self.args.budget_s:.0f} s budget")
        (self.out / "table.txt").write_text(printed.getvalue())
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1) + "\n")
        sys.stdout.write(printed.getvalue())
        return int(any(status.startswith("failed") or status == "out of time" for _, status, _, _ in self.rows))


def table_rows(record: dict, title: str) -> list[list]:
    """The rows of the run's one table whose title begins with `title` (none when it printed none)."""
    return next((table["rows"] for table in record["tables"] if table["title"].startswith(title)), [])


def serving_figures(record: dict) -> str:
    """tok/s per path, TTFT p50/p99 of the streamed paths and cbatch's host ms a step over HTTP."""
    rates = ", ".join(f"{path} {cell(tok_s)} tok/s" for path, tok_s, *_ in table_rows(record, "paths at "))
    ttft = [f"{path} TTFT p50 {cell(p50)} p99 {cell(p99)} ms"
            for path, p50, _, p99 in table_rows(record, "time to first token ")]
    host = [f"{path} host {cell(host_ms)} ms a step"
            for path, *_, host_ms in table_rows(record, "the decode worker's steps ") if path == "cbatch HTTP whole"]
    return "; ".join([rates, *ttft, *host])


def host_work_figures(record: dict) -> str:
    """Host ms of a decode step, and the whole step's, per mode, level and backend sampling."""
    return "; ".join(f"{mode} {seqs} backend {backend}: host {cell(host_ms)} of {cell(step_ms)} ms"
                     for mode, seqs, backend, *_, host_ms, _, step_ms in table_rows(record, "ms per decode step"))


def long_figures(record: dict) -> str:
    """Each workload's rate per configuration and the ratios, from the run's last table."""
    summary = record["tables"][-1]
    return "; ".join(f"{workload}: " + ", ".join(f"{column} {cell(value)}"
                                                 for column, value in zip(summary["columns"][1:], figures))
                     for workload, *figures in summary["rows"])


def versions(run: Run) -> None:
    for name, command in [("nvidia-smi",
                           "nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader"),
                          ("nvcc", "nvcc --version | tail -n 2"),
                          ("cbatch", "git rev-parse HEAD"),
                          ("llama-cpp-python", f"{PYTHON} -c 'import llama_cpp; print(llama_cpp.__version__)'")]:
        code, text = sh(command, 30, run.out / f"version-{name}.log")
        run.summary["versions"][name] = text.strip() if code == 0 else "absent"
    sdist = next(Path(run.args.stage_dir).glob("llama_cpp_python-*"), None)
    run.summary["versions"]["sdist"] = sdist.name if sdist else "absent"
    commit = Path(run.args.stage_dir) / "llama.cpp.commit"
    run.summary["versions"]["llama.cpp"] = commit.read_text().strip() if commit.exists() else "absent"
    run.add("versions", "ok", 0, "; ".join(f"{k}: {v.splitlines()[-1] if v else '-'}"
                                            for k, v in run.summary["versions"].items()))


def build(run: Run) -> str | None:
    """Build both from the vendored llama.cpp for this GPU only; the llama-server path, or None."""
    stage_dir = Path(run.args.stage_dir).resolve()
    src = stage_dir / "src"
    arch = "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d .)"
    flags = f"-DGGML_CUDA=ON -DGGML_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES={arch} -DCMAKE_BUILD_TYPE=Release -G Ninja"
    unpack = f"mkdir -p {src} && tar -xzf {stage_dir}/llama_cpp_python-*.tar.gz -C {src}"
    server = (f"cmake -S {src}/llama_cpp_python-*/vendor/llama.cpp -B build/llama-server/cmake {flags} "
              "-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF && "
              "cmake --build build/llama-server/cmake --target llama-server && mkdir -p build/llama-server/bin && "
              f"cp build/llama-server/cmake/bin/llama-server build/llama-server/bin/")
    binding = (f"CMAKE_ARGS=\"{flags}\" python3 -m pip install -q --no-index --no-build-isolation --no-deps "
               f"--target /tmp/site {src}/llama_cpp_python-*/")
    if not run.stage("build", f"{unpack} && ({server}) & ({binding}) ; wait"):
        return None
    return str(REPO / "build/llama-server/bin/llama-server")


def model_path(run: Run) -> str:
    if run.args.model:
        return run.args.model
    joined = Path(run.args.stage_dir) / "gemma-3-270m-q4_k_m.gguf"
    parts = sorted(Path(run.args.stage_dir).glob("gemma-3-270m-q4_k_m.gguf.part*"))
    if not joined.exists() and parts:
        with joined.open("wb") as target:
            for part in parts:
                with part.open("rb") as chunk:
                    shutil.copyfileobj(chunk, target)
    run.add("model", "ok" if joined.exists() else "absent", 0, f"{joined} from {len(parts)} chunks")
    return str(joined)


def measure(run: Run, model: str, llama_server: str | None) -> None:
    a = run.args
    server = f" --llama-server {llama_server}" if llama_server else ""
    if not llama_server:
        run.add("llama-server", "skipped", 0, "no binary (build it, or give --llama-server)")
    for parallel in a.parallel:
        run.bench(f"serving {parallel}", f"serving --model {model} --parallel {parallel} "
                                         f"--clients {min(parallel, a.clients)} --requests {a.requests} "
                                         f"--max-tokens {a.max_tokens} --threads {a.threads}{server}", serving_figures)
    run.bench("host-work", f"host_work --parallel {' '.join(map(str, a.parallel))} --steps {a.steps} "
                           "--modes greedy sampled --backend-sampling off on"
                           + (f" --vocab 1024 --model {run.out}/stand-in.gguf" if a.mode == "rehearse" else ""),
              host_work_figures)
    run.bench("long", f"long_prompts --model {model} --parallel {a.parallel[-1]} "
                      # it finds llama-server where the build stage (and scripts/build_llama_server.sh) put it
                      f"--clients {min(a.parallel[-1], a.clients)} --requests 1 --workloads short,unique "
                      f"--configs streams,llama-server --file-lines 0 --no-cache-file-lines 0", long_figures)


def main(argv=None) -> int:
    parser = bench_parser(__doc__, model=None, parallel=[16, 64, 256],
                          clients=(256, "closed-loop callers, at most --parallel"),
                          requests=(1024, "requests per path"), max_tokens=128)
    parser.add_argument("--mode", choices=["full", "compare", "rehearse"], default="full")
    parser.add_argument("--budget-s", type=float, default=540, help="stop by itself within this (default 9 min)")
    parser.add_argument("--threads", type=int, default=4, help="llama.cpp threads for both servers (GPU: few)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps measured for host work")
    parser.add_argument("--model", help="GGUF (default: the gemma chunks joined from --stage-dir)")
    parser.add_argument("--stage-dir", default=os.environ.get("STAGE_DIR", "/tmp/stage"),
                        help="where `scripts/gpu_compare.sh stage` copied what `prepare` staged")
    parser.add_argument("--llama-server", help="a llama-server binary (full mode builds one)")
    args = parser.parse_args(argv)
    run = Run(args)
    versions(run)
    llama_server = args.llama_server
    if args.mode == "full":
        llama_server = build(run) or llama_server
        run.stage("gpu-tests", f"{PYTHON} -m pytest -q -m gpu tests; c=$?; [ $c -eq 0 ] || [ $c -eq 5 ]")
    else:
        run.add("build", "skipped", 0, f"{args.mode} mode: no build")
    model = model_path(run)
    measure(run, model, llama_server)
    return run.finish()

