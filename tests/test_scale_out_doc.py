"""docs/scale-out.md as printed: the recipe (two daemons on the default model and smg in
front), the openai client and the batch file through the router, the one-machine
launcher, and the benchmark on a small configuration. Free ports stand in for
8000-8003 (fixed ports may be taken on a shared machine); the rest runs unchanged, in a
scratch directory as the README test runs every other file's examples."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
from common import default_sigint, free_port
from conftest import REPO
from daemonkit import child_pids, pid_alive
from test_readme import BACKGROUND, Scratch  # noqa: F401  (not tests: nothing is collected twice)

from cbatch.errors import EXIT_FAILED

DOC = "docs/scale-out.md"
DOC_PORTS = ("8000", "8001", "8002", "8003")
RUN_HERE = re.compile(r"<!-- readme-test: skip: [^>]*tests/test_scale_out_doc\.py[^>]*-->\n```(\w*)\n(.*?)```", re.S)


def _examples() -> list[tuple[str, str]]:
    return RUN_HERE.findall((REPO / DOC).read_text())


def _with_free_ports(code: str, ports: dict[str, str]) -> str:
    return re.sub(r"\b(800[0-3])\b", lambda match: ports[match.group(1)], code)


def test_the_recipe_runs_as_printed(tmp_path):
    examples = _examples()
    assert [language for language, _ in examples] == ["sh", "python", "sh", "sh", "sh"]
    ports = {name: str(free_port()) for name in DOC_PORTS}
    router_url = f"http://127.0.0.1:{ports['8000']}"
    recipe, client, submit = (_with_free_ports(code, ports) for _, code in examples[:3])
    scratch = Scratch(tmp_path)
    try:
        # As pasted: a background line goes on at once, and only the recipe's own lines
        # (curl until /health, then /readiness, answers) wait; the client runs right after.
        for line in recipe.strip().splitlines():
            background = BACKGROUND.match(line)
            if background:
                scratch.start_daemon(background.group(1).strip(), is_waited=False)
            else:
                waited = scratch.run(["bash", "-c", line])
                assert waited.returncode == 0, f"{line!r} exited {waited.returncode}: {waited.stderr}"
        printed = scratch.run([sys.executable, "-c", client])
        assert printed.returncode == 0 and "100" in printed.stdout, printed.stderr

        submitted = scratch.run(["bash", "-c", submit.strip()])
        assert submitted.returncode == EXIT_FAILED, submitted.stderr  # the file's last line is bad on purpose
        results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
        inputs = [json.loads(line) for line in (REPO / "scripts" / "example_prompts.jsonl").read_text().splitlines()]
        assert [result["id"] for result in results] == [item["id"] for item in inputs]
        assert ["text" in result for result in results] == [True] * 7 + [False], results
        assert results[-1]["error"]["code"] == "invalid_request"
        refused = httpx.post(f"{router_url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)  # no key
        assert refused.status_code == 401
        assert not scratch.unignored_files(), "the recipe leaves files .gitignore does not cover"
    finally:
        codes = scratch.stop_daemons()
    assert codes == [0, 0, 0]


def test_the_launcher_starts_and_stops_everything(tmp_path, tiny_model_path):
    _, launcher = _examples()[3]
    port = str(free_port())
    command = _with_free_ports(launcher.strip(), {"8000": port}).split()
    # the tiny model in place of the default (flags after -- go to every daemon), no pinning
    # (the test may run where fewer CPUs are allowed)
    command = [part for part in command if part != "--pin"] + ["--model", tiny_model_path]
    process = subprocess.Popen([sys.executable if part == ".venv/bin/python" else part for part in command],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=default_sigint)
    try:
        ready = process.stdout.readline()
        assert ready.startswith(f"router at http://127.0.0.1:{port}/v1 in front of 2 daemons"), ready
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": model, "prompt": "x", "max_tokens": 3})
        assert reply.json()["usage"]["completion_tokens"] == 3
        daemon_pids = child_pids(process.pid)
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:  # a failed stop: its daemons and router must not outlive the test
            for pid in [*child_pids(process.pid), process.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, out
    assert "stopped: router and 2 daemons (exit codes [0, 0])" in out
    assert len(daemon_pids) == 3 and not any(pid_alive(pid) for pid in daemon_pids)  # 2 daemons and smg


@pytest.mark.slow
def test_the_benchmark_runs(tiny_model_path, tmp_path):
    _, bench = _examples()[4]
    command = bench.strip().split()
    assert command[:3] == [".venv/bin/python", "scripts/bench.py", "scale_out"]
    small = ["--model", tiny_model_path, "--requests", "4", "--max-tokens", "4", "--concurrency", "2",
             "--prefixes", "2", "--questions", "2", "--prefix-words", "40", "--port", str(free_port())]
    runs = tmp_path / "runs.jsonl"
    result = subprocess.run([sys.executable, "scripts/bench.py", "--json", str(runs), "scale_out", *small], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (record,) = [json.loads(line) for line in runs.read_text().splitlines()]
    (loads,) = record["tables"]
    rows = {row[0]: dict(zip(loads["columns"], row)) for row in loads["rows"]}
    assert list(rows) == ["1. one daemon, direct", "1. one daemon, through smg", "2. two daemons, through smg",
                          "3. prefixes, cache_aware", "3. prefixes, round_robin"], result.stdout
    assert all(row["tok/s"] > 0 and row["failed"] == 0 for row in rows.values()), result.stdout
    assert [row["prefix hits %"] is not None for row in rows.values()] == [False] * 3 + [True] * 2, result.stdout
    assert [line.split(":")[0] for line in record["notes"][1:]] == [
        "through the router / direct", "two daemons / one direct", "cache_aware / round_robin"], record["notes"]

