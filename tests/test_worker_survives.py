"""No request body takes the decode worker down. A grammar that allows only the end of
generation while min_tokens holds it back, or a grammar no token can satisfy,
made llama.cpp abort the worker and every caller's request with it; such a request now ends
on its own (as `stop` once its grammar is complete, else with invalid_request), through the
native client, HTTP (grammar, json_schema, a forced tool call) and a batch file, while the
worker's pid stays the same and a bystander's stream goes on."""

import threading
from pathlib import Path

import pytest
from daemonkit import serve_module, submit_lines, wait_until
from httpkit import HttpDaemon

from cbatch.errors import CbatchError

ONE_A = 'root ::= "a"'  # complete after one token: then only the end of generation is allowed
NUL_ONLY = "%llguidance {}\nstart: NONE\nNONE: /a/ & /b/"  # a lexeme no text matches: nothing is ever allowed
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
TOOL = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
BYSTANDER_TOKENS = 400


@pytest.fixture(scope="module")
def daemon(tiny_tools_model_path):
    yield from serve_module(HttpDaemon(tiny_tools_model_path, "--parallel", "4"))


def worker_pid(daemon) -> int:
    return daemon.new_decode_worker_pid()


class Bystander:
    """A long stream of another caller, read to its end in a thread."""

    def __init__(self, daemon):
        self.result = None
        self.client = daemon.client()
        self.stream = self.client.stream(prompt="a bystander's story", max_tokens=BYSTANDER_TOKENS, ignore_eos=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        self.result = [chunk.finish_reason for chunk in self.stream]

    def finished(self, timeout_s: float = 120.0) -> str | None:
        self.thread.join(timeout_s)
        self.client.close()
        return self.result[-1] if self.result else None


@pytest.mark.parametrize("extra", [{"min_tokens": 5}, {"min_tokens": 5, "logit_bias": {"2": 100}},
                                   {"min_tokens": 3, "temperature": 0.9, "seed": 4}])
def test_a_complete_grammar_held_open_ends_as_stop(daemon, extra):
    pid = worker_pid(daemon)
    bystander = Bystander(daemon)
    with daemon.client() as client:
        result = client.generate(prompt="say a", max_tokens=8, grammar=ONE_A, **extra)
    assert (result.text, result.finish_reason) == ("a", "stop")
    assert bystander.finished() == "length"
    assert worker_pid(daemon) == pid


def test_a_grammar_no_token_satisfies_fails_only_its_request(daemon):
    pid = worker_pid(daemon)
    bystander = Bystander(daemon)
    with daemon.client() as client:
        with pytest.raises(CbatchError) as caught:
            client.generate(prompt="x", max_tokens=4, grammar=NUL_ONLY)
        assert caught.value.code == "invalid_request" and "the constraint allows no" in caught.value.message
        assert client.generate(prompt="x", max_tokens=3).usage["completion_tokens"] == 3
    assert bystander.finished() == "length"
    assert worker_pid(daemon) == pid


def test_json_schema_and_forced_tool_calls_with_min_tokens_over_http(daemon, api):
    model = api.models.list().data[0].id
    pid = worker_pid(daemon)
    bystander = Bystander(daemon)
    messages = [{"role": "user", "content": "hi"}]
    schema = api.chat.completions.create(
        model=model, messages=messages, max_tokens=64, extra_body={"min_tokens": 60},
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    assert schema.choices[0].finish_reason in ("stop", "length")
    forced = api.chat.completions.create(
        model=model, messages=messages, max_tokens=64, tools=[TOOL], extra_body={"min_tokens": 60},
        tool_choice={"type": "function", "function": {"name": "ping"}})
    assert forced.choices[0].finish_reason in ("tool_calls", "stop", "length")
    completion = api.completions.create(model=model, prompt="say a", max_tokens=8,
                                        extra_body={"grammar": ONE_A, "min_tokens": 4})
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == ("a", "stop")
    assert bystander.finished() == "length"
    assert worker_pid(daemon) == pid


def test_a_batch_file_of_dead_end_grammars_is_answered(daemon, tmp_path):
    pid = worker_pid(daemon)
    lines = [{"id": f"a{i}", "prompt": "say a", "max_tokens": 6, "grammar": ONE_A, "min_tokens": 4} for i in range(6)]
    lines += [{"id": "nul", "prompt": "x", "max_tokens": 4, "grammar": NUL_ONLY}]
    done, results = submit_lines(daemon.env, lines, tmp_path, timeout_s=180)
    assert done.returncode == 1, done.stderr  # the unsatisfiable line fails, alone
    assert all(results[f"a{i}"]["text"] == "a" and results[f"a{i}"]["finish_reason"] == "stop" for i in range(6))
    assert results["nul"]["error"]["code"] == "invalid_request"
    assert worker_pid(daemon) == pid


CRASH_IN_GRAMMAR = Path(__file__).parent / "crash_in_grammar"  # a sitecustomize that aborts grammar sampling


def test_a_request_shape_that_crashed_the_worker_is_refused(tiny_model_path, start_daemon, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(CRASH_IN_GRAMMAR))
    crashing = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 8192))
    with crashing.client() as client:
        first_pid = client.health()["worker_pid"]
        bystander = client.stream(prompt="a bystander", max_tokens=8000, ignore_eos=True)
        next(bystander)
        with pytest.raises(CbatchError) as caught:
            client.generate(prompt="x", max_tokens=4, grammar=ONE_A, min_tokens=2)
        assert caught.value.code == "invalid_request" and "made the decode worker crash" in caught.value.message
        with pytest.raises(CbatchError) as lost:
            list(bystander)
        assert lost.value.code == "worker_restarted"  # a transient error: batch callers resubmit it
        wait_until(lambda: client.health()["worker_pid"] not in (0, first_pid), timeout_s=120)
        second_pid = client.health()["worker_pid"]
        for prompt, seed in (("another prompt", 3), ("x", 9)):  # the same parameters, whatever the text
            with pytest.raises(CbatchError) as refused:
                client.generate(prompt=prompt, max_tokens=4, grammar=ONE_A, min_tokens=2, seed=seed)
            assert refused.value.code == "invalid_request" and "refuses them" in refused.value.message
        assert client.generate(prompt="plain", max_tokens=3).usage["completion_tokens"] == 3
        assert client.health()["worker_pid"] == second_pid
    assert "its shape is quarantined" in crashing.log()


CRASH_IN_MASKS = Path(__file__).parent / "crash_in_masks"  # a sitecustomize that aborts filling constrained masks
ANY_BYTES = 'root ::= [\\x00-\\xff]*'  # every byte token: the plain pick always passes, no mask is made


def test_a_crash_filling_one_rows_mask_names_that_row_not_the_last_checked(tiny_model_path, start_daemon,
                                                                           monkeypatch):
    """Two constrained rows in a step, the first in the batch missing its constraint, the
    second passing it: a crash while the first's mask is made quarantines the first's shape."""
    monkeypatch.setenv("PYTHONPATH", str(CRASH_IN_MASKS))
    daemon = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 8192))
    passing = {"prompt": "any bytes", "max_tokens": 6000, "grammar": ANY_BYTES, "min_tokens": 6000}
    with daemon.client() as client:
        first_pid = client.health()["worker_pid"]
        holder = client.submit(prompt="a holder", max_tokens=6000, ignore_eos=True)  # the first slot
        passing_stream = client.stream(**passing)  # the second slot
        next(passing_stream)
        client.cancel(holder.request_id)
        list(client.read(holder))
        with pytest.raises(CbatchError) as caught:  # in the first slot, before the passing row
            client.generate(prompt="x", max_tokens=4, grammar=ONE_A, min_tokens=2)
        assert caught.value.code == "invalid_request" and "made the decode worker crash" in caught.value.message
        with pytest.raises(CbatchError) as lost:
            list(passing_stream)
        assert lost.value.code == "worker_restarted"
        wait_until(lambda: client.health()["worker_pid"] not in (0, first_pid), timeout_s=120)
        assert client.generate(**{**passing, "max_tokens": 8, "min_tokens": 8}).finish_reason == "length"  # not refused
    assert daemon.log().count("its shape is quarantined") == 1
