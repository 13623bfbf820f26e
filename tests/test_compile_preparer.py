"""A constraint's compile runs on a preparer of its own: a request sent after one whose
schema takes long to compile is answered meanwhile. A schema that fails to compile is
refused again at once, from the refusals kept by its text."""

import time
from pathlib import Path

import pytest

from cbatch.errors import CbatchError
from cbatch.params import parse_params

SLOW_COMPILE = Path(__file__).parent / "slow_compile"
SLOW_S = 8.0  # as the sitecustomize sleeps
SLOW_SCHEMA = {"type": "object", "properties": {"slow_compile": {"type": "integer"}}}


def test_a_small_request_does_not_wait_behind_a_slow_compile(tiny_model_path, start_daemon, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(SLOW_COMPILE))
    daemon = start_daemon(tiny_model_path, "--parallel", "2")
    with daemon.client() as client:
        started = time.monotonic()
        slow = client.submit(prompt="data:", max_tokens=16, json_schema=SLOW_SCHEMA)
        plain = client.generate(prompt="a small request", max_tokens=4, timeout=SLOW_S / 2)
        assert plain.usage["completion_tokens"] == 4 and time.monotonic() - started < SLOW_S
        assert list(client.read(slow))[-1].finish_reason in ("stop", "length")
        started = time.monotonic()  # compiled now, and kept: no second wait
        client.generate(prompt="data:", max_tokens=4, json_schema=SLOW_SCHEMA)
        assert time.monotonic() - started < SLOW_S


def test_a_schema_that_failed_to_compile_is_refused_again_without_compiling(make_engine, monkeypatch):
    compiler = make_engine().structured.compiler
    params = parse_params({"json_schema": {"type": "nonsense"}})
    assert compiler.needs_compile(params)
    with pytest.raises(CbatchError) as first:
        compiler.matcher(params)
    monkeypatch.setattr(compiler, "_compile", lambda params: pytest.fail("compiled again"))
    assert not compiler.needs_compile(params)
    with pytest.raises(CbatchError) as again:
        compiler.matcher(params)
    assert again.value.message == first.value.message and first.value.code == "invalid_request"
