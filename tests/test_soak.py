"""Short soaks through the real daemon: the same script as the long one, fewer requests."""

import subprocess
import sys

import pytest
from conftest import REPO
from test_benchmarks import run_bench, table


@pytest.mark.parametrize("args", [
    ("--requests", "300", "--clients", "16"),
    # An 8-record ring holds one step of the 8 sequences: nearly every ring read is lapped,
    # so nearly every token reaches its reader through overrun recovery.
    ("--requests", "150", "--clients", "8", "--ring-capacity", "8"),
], ids=["default-ring", "tiny-ring"])
def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path, args):
    record = run_bench(tmp_path, "soak", *args)
    assert record["status"] == 0 and record["notes"][-1] == "SOAK PASSED", record["output"]
    figures = dict(table(record, "Delivered against generated")["rows"])
    assert figures["requests with a mismatch"] == 0, record["output"]
    if "--ring-capacity" in args:
        assert figures["FETCHes answered (lapped ring readers)"] >= 10, record["output"]


def test_a_failed_soak_fails_the_bench_entry(tmp_path):
    """The entry exits with the bench's own status: a daemon that cannot start fails the soak."""
    not_a_model = tmp_path / "not-a-model.gguf"
    not_a_model.write_text("plain text, not GGUF")
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "soak", "--model", str(not_a_model),
                          "--requests", "1", "--clients", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "SOAK FAILED: the daemon exited" in run.stdout, run.stdout + run.stderr
