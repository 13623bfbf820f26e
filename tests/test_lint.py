"""ruff's lint over the whole tree (pyproject.toml's rules: pyflakes, pycodestyle, import
order, lines of at most 120 characters), so a test run catches what .ci/run would."""

import subprocess
import sys

from conftest import REPO


def test_the_tree_passes_ruff():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
