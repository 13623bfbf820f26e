"""Start-up removes what dead daemons left behind, and nothing of a live one."""

import fcntl
import os
import subprocess
import sys

from daemonkit import pid_alive

from cbatch.workers.daemon.leftovers import remove_leftovers


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)
    return child.pid


def test_dead_daemons_files_go_and_live_ones_stay(tmp_path):
    runtime, shm = tmp_path / "run", tmp_path / "shm"
    runtime.mkdir()
    shm.mkdir()
    dead, live = dead_pid(), os.getpid()
    names = {
        runtime: [f"cbatch-{dead}-control.sock", f"cbatch-{dead}-tick.sock", f"cbatch-{live}-tick.sock",
                  "stale.sock", "stale.sock.lock", "served.sock", "served.sock.lock", "notes.txt"],
        shm: [f"cbatch-{dead}", f"cbatch-{dead}-ring3", f"cbatch-{live}", f"cbatch-{live}-ring3", "other-segment"],
    }
    for directory, files in names.items():
        for name in files:
            (directory / name).write_text("")
    held = os.open(runtime / "served.sock.lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live daemon's endpoint
    try:
        removed = remove_leftovers(str(runtime), str(shm))
    finally:
        os.close(held)
    assert sorted(os.path.basename(p) for p in removed) == sorted(
        [f"cbatch-{dead}-control.sock", f"cbatch-{dead}-tick.sock", "stale.sock", "stale.sock.lock", f"cbatch-{dead}",
         f"cbatch-{dead}-ring3"])
    assert sorted(os.listdir(runtime)) == sorted(
        [f"cbatch-{live}-tick.sock", "served.sock", "served.sock.lock", "notes.txt"])
    assert sorted(os.listdir(shm)) == sorted([f"cbatch-{live}", f"cbatch-{live}-ring3", "other-segment"])
