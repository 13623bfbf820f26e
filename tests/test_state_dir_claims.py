"""A state directory belongs to one daemon and one model: two daemons on one host, or one
endpoint served with one model and then another, get a directory each by default, and a
daemon refuses, at its start, in one line naming the directory, an explicit --state-dir
that another running daemon uses or that was made for another model."""

import subprocess

from common import free_port
from daemonkit import SCRIPTS_DIR

START_TIMEOUT_S = 120.0


def refusal(model_path: str, state_dir, env: dict) -> subprocess.CompletedProcess:
    """A daemon started on `state_dir`, which must exit at once (2: a setting to change)."""
    return subprocess.run([str(SCRIPTS_DIR / "cbatch-worker"), "--model", model_path, "--http",
                           f"127.0.0.1:{free_port()}", "--endpoint", f"ipc://{state_dir}/other.sock",
                           "--state-dir", str(state_dir)], env=env, capture_output=True, text=True,
                          timeout=START_TIMEOUT_S)


def test_two_daemons_keep_their_files_apart(start_http_daemon, tiny_model_path):
    first = start_http_daemon(tiny_model_path, "--parallel", "1")
    # The same $XDG_STATE_HOME (the workdir's), another endpoint: as two daemons on one host.
    second = start_http_daemon(tiny_model_path, "--parallel", "1", workdir=first.workdir,
                               endpoint=f"ipc://{first.workdir}/second.sock")
    assert first.state_dir() != second.state_dir() and first.state_dir().is_dir() and second.state_dir().is_dir()
    uploaded = first.openai().files.create(file=("in.jsonl", b'{"a": 1}\n'), purpose="batch")
    assert uploaded.id in [f.id for f in first.openai().files.list()]
    assert uploaded.id not in [f.id for f in second.openai().files.list()]


def test_a_directory_another_daemon_runs_is_refused(start_http_daemon, tiny_model_path):
    running = start_http_daemon(tiny_model_path, "--parallel", "1")
    state_dir = running.state_dir()
    done = refusal(tiny_model_path, state_dir, running.env)
    assert done.returncode == 2 and "in use by another running daemon" in done.stderr and str(state_dir) in done.stderr
    assert done.stderr.count("\n") == 1 and "usage:" not in done.stderr  # one line: what to change


def test_a_directory_made_for_another_model_is_refused(start_http_daemon, tiny_model_path, tiny_tools_model_path):
    first = start_http_daemon(tiny_model_path, "--parallel", "1")
    uploaded = first.openai().files.create(file=("in.jsonl", b'{"a": 1}\n'), purpose="batch")
    state_dir = first.state_dir()
    first.stop()
    done = refusal(tiny_tools_model_path, state_dir, first.env)
    assert done.returncode == 2 and "holds the files and jobs of model 'tiny-llama.gguf'" in done.stderr, done.stderr
    # By default the same endpoint with another model is another directory: it starts.
    other = start_http_daemon(tiny_tools_model_path, "--parallel", "1", workdir=first.workdir,
                              endpoint=first.endpoint)
    assert uploaded.id not in [f.id for f in other.openai().files.list()]
    other.stop()
    again = start_http_daemon(tiny_model_path, "--parallel", "1", workdir=first.workdir,
                              endpoint=first.endpoint)  # its own model: its own files again
    assert uploaded.id in [f.id for f in again.openai().files.list()]
