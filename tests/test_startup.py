"""Starting and stopping the daemon: a user's mistake (a taken endpoint, a missing
directory, a model file that is not there or cannot be read or loaded) is one line and
exit code 1, never a traceback; an idle daemon stops at once."""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from common import default_sigint
from daemonkit import SCRIPTS_DIR, child_pids, wait_until


@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="cbt-"))  # short enough for a socket path
    (path / "run").mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_worker(workdir: Path, model: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = env or {**os.environ, "XDG_RUNTIME_DIR": str(workdir / "run"), "CBATCH_ENDPOINT": f"ipc://{workdir}/d.sock"}
    return subprocess.run([str(SCRIPTS_DIR / "cbatch-worker"), "--model", model, *args], env=env,
                          capture_output=True, text=True, timeout=120)


def assert_one_line(daemon: subprocess.CompletedProcess, reason: str) -> None:
    lines = daemon.stderr.splitlines()
    assert daemon.returncode == 1 and len(lines) == 1, daemon.stderr
    assert lines[0].startswith("cbatch-worker: ") and reason in lines[0] and "Traceback" not in daemon.stderr


def test_second_daemon_on_the_same_endpoint_fails_fast(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "1")
    try:
        started = time.monotonic()
        second = run_worker(d.workdir, tiny_model_path, env=d.env)
        assert time.monotonic() - started < 10
        assert_one_line(second, "another cbatch-worker is serving")
        with d.client() as client:  # the first one is untouched
            assert client.generate(prompt="x", max_tokens=3).finish_reason in ("length", "stop")
    finally:
        assert d.stop() == 0


def test_an_endpoint_in_a_missing_directory_is_one_line(tiny_model_path, workdir):
    daemon = run_worker(workdir, tiny_model_path, "--endpoint", f"ipc://{workdir}/missing/d.sock")
    assert_one_line(daemon, "does its directory exist?")


def test_a_missing_model_file_fails_before_any_worker_starts(workdir):
    started = time.monotonic()
    daemon = run_worker(workdir, str(workdir / "missing.gguf"))
    assert_one_line(daemon, "model file not found")
    # Nothing was created: no ring, no sockets, no worker (which alone takes seconds to start).
    assert time.monotonic() - started < 10
    assert sorted(p.name for p in workdir.iterdir()) == ["run"] and not any((workdir / "run").iterdir())


@pytest.mark.parametrize("kind", ["no read permission", "a directory"])
def test_a_model_file_that_cannot_be_read_says_why(tiny_model_path, workdir, kind):
    model = workdir / "model.gguf"
    if kind == "a directory":
        model.mkdir()
        reason = "is a directory"
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads a file whatever its mode")
        shutil.copy(tiny_model_path, model)
        model.chmod(0)
        reason = "permission denied"
    assert_one_line(run_worker(workdir, str(model)), reason)


def test_worker_that_cannot_start_ends_the_daemon_with_its_reason(workdir):
    bad_model = workdir / "not-a-model.gguf"
    bad_model.write_bytes(b"GGUF" + os.urandom(4096))
    started = time.monotonic()
    daemon = run_worker(workdir, str(bad_model))
    # A model that does not load is a setting to change, not a crash to retry: one line, at once.
    assert daemon.returncode == 1
    assert "could not load" in daemon.stderr and "Traceback" not in daemon.stderr
    assert "failed to start" not in daemon.stderr and time.monotonic() - started < 30
    assert [list(p.iterdir()) for p in (workdir / "run").iterdir()] == [[]]
    assert sorted(p.name for p in workdir.iterdir()) == ["not-a-model.gguf", "run"]


def test_an_idle_daemon_stops_at_once_on_sigterm(tiny_model_path, start_daemon):
    # Nothing to drain: the loop notices the signal within one poll (0.1 s), the worker
    # wakes from its idle wait on WORKER_STOP; the rest is the two interpreters exiting.
    d = start_daemon(tiny_model_path, "--parallel", "2")
    with d.client() as client:
        client.generate(prompt="x", max_tokens=3)
    d.process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert d.process.wait(timeout=30) == 0, d.log()
    assert time.monotonic() - started < 3.0  # 0.2-0.3 s measured; the bound leaves room for a loaded machine
    assert d.leftovers() == []


def test_threads_default_to_the_cpus_the_daemon_may_use(tiny_model_path, start_daemon):
    """Pinned to one CPU (as taskset or a container's cpuset does), the daemon runs one
    llama.cpp thread, not one per core of the machine, and its ready line says so."""
    usable = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(usable)})  # the daemon inherits it
    try:
        d = start_daemon(tiny_model_path, "--parallel", "2")
    finally:
        os.sched_setaffinity(0, usable)
    assert ", 1 threads," in d.log()
    with d.client() as client:
        assert client.generate(prompt="pinned", max_tokens=4).usage["completion_tokens"] == 4


def test_a_client_started_beside_a_starting_daemon_waits_for_it(tiny_model_path, workdir):
    """The quick start pasted as one block: cbatch-submit runs while the daemon is still
    importing itself. The daemon holds its endpoint's lock from its first moment, so the
    client waits (saying so) instead of reporting that no daemon answers."""
    socket_path = workdir / "d.sock"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(workdir / "run"), "CBATCH_ENDPOINT": f"ipc://{socket_path}"}
    daemon = subprocess.Popen([str(SCRIPTS_DIR / "cbatch-worker"), "--model", tiny_model_path, "--parallel", "1"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _lock_is_held(socket_path), timeout_s=60, poll_s=0.002)
        os.kill(daemon.pid, signal.SIGSTOP)  # held between taking the lock and binding the socket
        if socket_path.exists():
            os.kill(daemon.pid, signal.SIGCONT)
            pytest.skip("the daemon bound its socket before it could be held")
        client = subprocess.Popen([str(SCRIPTS_DIR / "cbatch-status")], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: client.poll() is not None, timeout_s=2.0)
            early_exit = client.returncode
        except AssertionError:
            early_exit = None  # still waiting, as it should
        os.kill(daemon.pid, signal.SIGCONT)
        out, err = client.communicate(timeout=120)
        assert early_exit is None, err
        assert "waiting for the daemon starting at" in err
        assert client.returncode == 0, err
    finally:
        daemon.send_signal(signal.SIGCONT)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)


def _lock_is_held(socket_path: Path) -> bool:
    from cbatch.client.base import _is_daemon_starting

    return _is_daemon_starting(str(socket_path))


STOP_LINES = ("cbatch-worker: stopped while starting", "cbatch-worker stopped")


def _decode_worker_importing(pid: int) -> bool:
    """The decode worker has loaded llama.cpp's library: it is importing its modules, before
    its own code could set any signal handler."""
    for child in child_pids(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes() and \
                    "libllama" in Path(f"/proc/{child}/maps").read_text():
                return True
        except (FileNotFoundError, ProcessLookupError):
            continue
    return False


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:  # "state ppid pgrp"
                members.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return members


@pytest.mark.parametrize("moment", ["importing", "decode worker importing"])
def test_ctrl_c_while_starting_ends_in_one_line_and_leaves_nothing(tiny_model_path, workdir, moment):
    """Ctrl-C, as a terminal sends it (to the whole process group), in the daemon's first
    second: no traceback from it or from a child still importing itself, and nothing left
    behind (sockets, the lock, the ring in /dev/shm, processes). (Before the console
    script's first line, the interpreter's own start-up reads its site files: a Ctrl-C
    there is Python's to report.)"""
    socket_path = workdir / "d.sock"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(workdir / "run"), "CBATCH_ENDPOINT": f"ipc://{socket_path}"}
    with open(workdir / "daemon.log", "w") as log:
        daemon = subprocess.Popen([str(SCRIPTS_DIR / "cbatch-worker"), "--model", tiny_model_path, "--parallel", "1"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  preexec_fn=default_sigint)
    try:
        if moment == "importing":
            wait_until(lambda: _lock_is_held(socket_path) or daemon.poll() is not None, timeout_s=60, poll_s=0.002)
        elif moment == "decode worker importing":
            wait_until(lambda: _decode_worker_importing(daemon.pid) or daemon.poll() is not None, timeout_s=60,
                       poll_s=0.002)
        os.killpg(daemon.pid, signal.SIGINT)
        code = daemon.wait(60)
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
    output = (workdir / "daemon.log").read_text()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert code in (0, 130) and output.splitlines()[-1] in STOP_LINES, output
    if moment == "importing" and code == 130:
        assert output.splitlines() == [STOP_LINES[0]]
    wait_until(lambda: _group_members(daemon.pid) == [], timeout_s=120)
    assert sorted(p.name for p in workdir.iterdir()) == ["daemon.log", "run"]
    assert [p for p in (workdir / "run").rglob("*") if not p.is_dir()] == []
    assert [name for name in os.listdir("/dev/shm") if name.startswith(f"cbatch-{daemon.pid}")] == []


def test_a_state_dir_that_cannot_be_written_fails_the_start(tiny_model_path, workdir):
    (workdir / "a-file").write_text("")
    daemon = run_worker(workdir, tiny_model_path, "--http", "0", "--state-dir", str(workdir / "a-file" / "state"))
    assert daemon.returncode == 2 and "Traceback" not in daemon.stderr, daemon.stderr
    assert f"cannot write the state directory {workdir / 'a-file' / 'state'}" in daemon.stderr
    assert "pass another --state-dir" in daemon.stderr


def test_parallel_past_llama_cpps_sequence_ids_is_refused_in_one_line(tiny_model_path, workdir):
    daemon = run_worker(workdir, tiny_model_path, "--parallel", "257")
    assert daemon.returncode == 2 and "Traceback" not in daemon.stderr, daemon.stderr
    assert "--parallel must be in [1, 256], got 257" in daemon.stderr


def test_a_daemon_decodes_256_sequences_in_one_batch(tiny_model_path, start_daemon):
    """llama.cpp's limit on KV sequence ids, reached: 256 requests at once all run together
    (a cap of 64 held the rest in the queue) and each gets its own tokens."""
    d = start_daemon(tiny_model_path, "--parallel", "256", "--ctx-size", str(256 * 256), "--threads", "1")
    bodies = [{"prompt": f"item {i} of the wide batch", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
              for i in range(256)]
    with d.client() as client:
        results = list(client.generate_batch(bodies, max_in_flight=256))
        stats = client.stats()
    assert [r.usage["completion_tokens"] for r in results] == [48] * 256
    assert stats["parallel"] == 256
    assert stats["avg_concurrent_seqs"] > 64, stats["avg_concurrent_seqs"]
