"""A short soak through the real daemon: the same script as the long one, fewer requests."""

import subprocess
import sys

from conftest import REPO


def test_short_soak_loses_nothing_and_leaks_nothing():
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--requests", "300", "--clients", "16"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SOAK PASSED" in run.stdout and "requests with a mismatch: 0" in run.stdout
