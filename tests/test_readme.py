"""The examples of the README and of every file in docs/, run as printed, so that they
cannot drift.

Every fenced block in those files follows a marker comment (invisible when rendered):
  <!-- readme-test: run -->           run it: `sh` blocks line by line with bash (a line
                                      ending in `&` starts a daemon, and the next line runs
                                      once it answers), `python` blocks with this interpreter
  <!-- readme-test: run exit=N -->    the same; the block's last command exits N, as the
                                      block says
  <!-- readme-test: skip: REASON -->  a command that cannot run in a test (the full setup,
                                      a GPU build), skipped for the reason given
  <!-- readme-test: text -->          not a command: a synopsis, a signature list, figures
A block without a marker fails. Each file's blocks run in order in a scratch directory of
its own that has the repository's `.venv` and `scripts/`, so relative paths work, and with
a private runtime directory, so the daemon a file starts listens on the default endpoint.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cbatch.client import Client
from cbatch.errors import CbatchError

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- readme-test: (run(?: exit=(\d+))?|skip: .+|text) -->")
BACKGROUND = re.compile(r"^(.*?)&\s*(#.*)?$")
ENDPOINT_FLAG = re.compile(r"--endpoint ipc://(\S+)")  # a path relative to where the command runs
DAEMON_READY_TIMEOUT_S = 300.0  # generous: the examples run on the default model, on a machine that may be busy
COMMAND_TIMEOUT_S = 300.0  # a pasted command includes the model load of a daemon started beside it
STOP_TIMEOUT_S = 30.0
DEMO_TIMEOUT_S = 600.0  # a model load and a few hundred tokens, on a machine that may be busy


DOC_FILES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]


@dataclass
class Block:
    where: str  # FILE:LINE of the opening fence
    language: str
    code: str
    marker: str | None
    exit_code: int = 0


def doc_blocks(name: str) -> list[Block]:
    lines = (REPO / name).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        start, language = i, lines[i][3:].strip()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        match = MARKER.fullmatch(lines[start - 1].strip()) if start else None
        blocks.append(Block(f"{name}:{start + 1}", language, "\n".join(lines[start + 1:end]), match and match.group(1),
                            int(match.group(2)) if match and match.group(2) else 0))
        i = end + 1
    return blocks


def test_every_block_is_marked():
    blocks = [block for name in DOC_FILES for block in doc_blocks(name)]
    unmarked = [b.where for b in blocks if b.marker is None]
    assert not unmarked, f"blocks without a readme-test marker: {unmarked}"
    assert all(b.language in ("sh", "python") for b in blocks if b.marker.startswith("run"))
    skipped = [b for b in blocks if b.marker.startswith("skip")]
    assert all(len(b.marker) > len("skip: ") for b in skipped)  # each says why


HTTP_DAEMON = re.compile(r"cbatch-worker .*--http (?:\S+:)?(\d+)\b.*&\s*(#.*)?$")
HTTP_READY_WAIT = "curl -sf --retry 300 --retry-connrefused --retry-delay 1 -o /dev/null http://127.0.0.1:{port}/health"


def test_every_block_that_starts_an_http_daemon_waits_until_it_serves():
    """Pasted, the next line runs at once: an HTTP client, unlike cbatch's own, does not wait
    for a daemon that is still loading its model (connection refused, then 503), so the
    block itself waits for the daemon's /health, as the first HTTP example does."""
    missing = [f"{block.where}: port {match.group(1)}" for name in DOC_FILES for block in doc_blocks(name)
               for match in map(HTTP_DAEMON.search, block.code.splitlines())
               if match and HTTP_READY_WAIT.format(port=match.group(1)) not in block.code]
    assert not missing, f"an HTTP daemon started without waiting for its /health: {missing}"


class Scratch:
    """Where one file's commands run, and the daemons they started."""

    def __init__(self, path: Path):
        self.path = path
        (path / ".venv").symlink_to(Path(sys.executable).parent.parent)
        (path / "scripts").symlink_to(REPO / "scripts")
        runtime = self.runtime = path / "run"
        runtime.mkdir(mode=0o700)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CBATCH_")}
        self.env["XDG_RUNTIME_DIR"] = str(runtime)
        self.endpoint = f"ipc://{runtime}/cbatch-{os.getuid()}/cbatch.sock"
        self.daemons: list[subprocess.Popen] = []

    def run(self, args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=self.path, env=self.env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)

    def start_daemon(self, command: str, is_waited: bool = True) -> None:
        """Start a daemon line (the `&` dropped); wait until it serves, or (is_waited false)
        go on at once, as a pasted block does."""
        endpoint = ENDPOINT_FLAG.search(command)
        endpoint = self.endpoint if endpoint is None else f"ipc://{self.path / endpoint.group(1)}"
        log = open(self.runtime / f"daemon-{len(self.daemons)}.log", "w")  # not among what the examples write
        process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.path, env=self.env,
                                   stdout=log, stderr=subprocess.STDOUT)
        self.daemons.append(process)
        if not is_waited:
            return
        deadline = time.monotonic() + DAEMON_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert process.poll() is None, f"{command!r} exited {process.returncode}: {log.name}"
            try:
                with Client(endpoint, connect_timeout_s=1.0) as client:
                    if client.health()["status"] == "ok":
                        return
            except CbatchError:
                pass  # not listening yet
            time.sleep(0.2)
        raise AssertionError(f"{command!r} did not become ready")

    def unignored_files(self) -> list[str]:
        """What the examples wrote where they ran that the repository's .gitignore lets
        through: run in a checkout, as printed, it would show in `git status`."""
        written = sorted(p.name for p in self.path.iterdir() if p.name not in (".venv", "scripts", "run"))
        if not written:
            return []
        check = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=REPO, capture_output=True,
                               text=True, timeout=COMMAND_TIMEOUT_S)
        assert check.returncode in (0, 1), check.stderr  # 1: none of them is ignored
        return sorted(set(written) - set(check.stdout.split()))

    def stop_daemons(self) -> list[int]:
        codes = []
        for process in self.daemons:
            process.send_signal(signal.SIGTERM)
            try:
                codes.append(process.wait(STOP_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
        return codes


def run_block(scratch: Scratch, block: Block) -> None:
    where = block.where
    if block.language == "python":
        result = scratch.run([sys.executable, "-c", block.code])
        assert result.returncode == block.exit_code, f"{where}: exit {result.returncode}\n{result.stderr}"
        assert result.stdout.strip(), f"{where} printed nothing"
        return
    commands = [line for line in block.code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    for number, command in enumerate(commands, 1):
        background = BACKGROUND.match(command)
        if background:
            # The next line starts at once, as when a user pastes the block: a client finds the
            # daemon starting and waits for it. An HTTP caller would not (curl has no such wait).
            command = background.group(1).strip()
            scratch.start_daemon(command, is_waited="--http" in command)
            continue
        result = scratch.run(["bash", "-c", command])
        expected = block.exit_code if number == len(commands) else 0
        assert result.returncode == expected, f"{where}: {command!r} exited {result.returncode}\n{result.stderr}"


@pytest.fixture
def scratch_dir():
    path = Path(tempfile.mkdtemp(prefix="cbr-"))  # short: socket paths must fit 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("name", DOC_FILES)
def test_examples_run_as_printed(scratch_dir, name):
    scratch = Scratch(scratch_dir)
    runnable = [block for block in doc_blocks(name) if block.marker.startswith("run")]
    try:
        for block in runnable:
            run_block(scratch, block)
        assert not scratch.unignored_files(), f"{name}'s examples leave files .gitignore does not cover"
    finally:
        exit_codes = scratch.stop_daemons()
    assert not runnable or scratch.daemons, f"{name} runs examples but starts no daemon for them"
    assert exit_codes == [0] * len(exit_codes)


def test_ci_runs_the_readme_test_command():
    """What CI runs is what a reader of the README runs."""
    readme_command = next(block.code for block in doc_blocks("README.md") if "pytest" in block.code).strip()
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd "))]
    assert " && ".join(ci_lines) == readme_command


SETUP_TIME = re.compile(r"(\d+) to (\d+) minutes on 2 cores")


def test_the_setup_time_is_one_range_wherever_it_is_stated():
    """What the README and docs/operations.md promise is what scripts/setup.sh says as it
    starts the compile: a range, since a busy machine takes several times a quiet one's."""
    stated = {name: SETUP_TIME.findall((REPO / name).read_text())
              for name in ("README.md", "docs/operations.md", "scripts/setup.sh")}
    ranges = {found for name in stated for found in stated[name]}
    assert all(stated.values()) and len(ranges) == 1, stated
    low, high = map(int, ranges.pop())
    assert high >= 2 * low, "a range a busy machine fits in"


def test_the_demo_answers_and_leaves_nothing_behind():
    """`./scripts/demo.sh`, the README's first command after the set-up: SmolLM2 answers,
    the bad line gets its error, and the repository is left as it was."""
    if Path(sys.prefix) != REPO / ".venv":
        pytest.skip("the demo runs the repository's .venv (it would run scripts/setup.sh to make one)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CBATCH_")}
    before = _git_status()
    demo = subprocess.run(["./scripts/demo.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=DEMO_TIMEOUT_S)
    assert demo.returncode == 0, demo.stderr
    first_answer = demo.stdout.splitlines()[:2]
    assert first_answer[0].startswith("[capital] (stop, ") and "Paris" in first_answer[1], demo.stdout
    assert "[bad] error invalid_request: top_p" in demo.stdout, demo.stdout
    assert _git_status() == before


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout
