"""cbatch-submit --resume answers every line of the input exactly once, however many times
it runs: a line that repeats an earlier line's id is refused (its refusal is its answer), a
line that is not a request is answered by its line number, and the summary counts what the
file holds."""

import json
import subprocess

import pytest
from daemonkit import SCRIPTS_DIR

from cbatch.errors import EXIT_FAILED

SUBMIT = str(SCRIPTS_DIR / "cbatch-submit")
QUICK = {"max_tokens": 2, "temperature": 0}


def _native(line_id, **extra) -> dict:
    return {"id": line_id, "prompt": f"line {line_id}", **QUICK, **extra}


def _openai(custom_id, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"line {custom_id}", **QUICK, **extra}}


# Each file: its lines, and what each non-blank line is answered by, in order: an id, or
# ("line", N) for a line known by its number; None where the answer is an error.
NATIVE = [_native("a"), "not json", _native("b"), _native("a"), "[1, 2]",
          {"prompt": "no id", **QUICK}, _native(6), "", _native("c", top_k=-1), _native("d")]
NATIVE_ANSWERS = [("a", True), (("line", 2), False), ("b", True), (("line", 4), False), (("line", 5), False),
                  (6, True), (("line", 7), False), ("c", False), ("d", True)]
OPENAI = [_openai("a"), "{cut", _openai("b"), _openai("a"), {"method": "POST", "body": {}}, _openai("c")]
OPENAI_ANSWERS = [("a", True), (("line", 2), False), ("b", True), (("line", 4), False), (("line", 5), False),
                  ("c", True)]


def _answer(result: dict):
    """(what a result line answers, whether it succeeded)."""
    error = result.get("error")
    if isinstance(error, dict) and "line" in error:
        return ("line", error["line"]), False
    if "custom_id" in result:
        return result["custom_id"], error is None and result["response"]["status_code"] == 200
    return result["id"], error is None


def _run(daemon, prompts, output) -> subprocess.CompletedProcess:
    return subprocess.run([SUBMIT, str(prompts), "-o", str(output), "--resume", "--max-in-flight", "2"],
                          env=daemon.env, capture_output=True, text=True, timeout=120)


def _summary(result: subprocess.CompletedProcess, noun: str) -> str:
    return result.stderr.strip().splitlines()[-1].split(";")[0].removeprefix("cbatch-submit: ")


@pytest.mark.parametrize("lines, answers, noun", [(NATIVE, NATIVE_ANSWERS, "lines"),
                                                  (OPENAI, OPENAI_ANSWERS, "OpenAI batch lines")],
                         ids=["native", "openai"])
def test_resume_answers_each_line_once_and_counts_what_it_did(start_daemon, tiny_model_path, tmp_path,
                                                             lines, answers, noun):
    daemon = start_daemon(tiny_model_path, "--parallel", "2")
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    num_failed = sum(not is_ok for _, is_ok in answers)

    first = _run(daemon, prompts, output)  # --resume with no output yet: a whole run
    assert first.returncode == EXIT_FAILED, first.stderr
    assert _summary(first, noun) == (f"{len(answers)} {noun} written, {len(answers) - num_failed} ok, "
                                     f"{num_failed} failed, 0 skipped as done by an earlier run")
    assert [_answer(json.loads(line)) for line in output.read_text().splitlines()] == answers
    refusal = json.loads(output.read_text().splitlines()[3])["error"]
    assert refusal["code"] == "invalid_request"
    assert refusal["message"] == 'line 4 repeats the id "a" of line 1: each line needs an id of its own'

    # An interrupted run's output: its first 4 lines and a cut one. Run twice, the rest is
    # written once, and then nothing more.
    kept = "".join(output.read_text().splitlines(keepends=True)[:4])
    output.write_text(kept + '{"id": "cut')
    second = _run(daemon, prompts, output)
    num_rest = len(answers) - 4
    num_rest_failed = sum(not is_ok for _, is_ok in answers[4:])
    assert _summary(second, noun) == (f"{num_rest} {noun} written, {num_rest - num_rest_failed} ok, "
                                      f"{num_rest_failed} failed, 4 skipped as done by an earlier run")
    third = _run(daemon, prompts, output)
    assert third.returncode == 0, third.stderr
    assert _summary(third,
                    noun) == f"0 {noun} written, 0 ok, 0 failed, {len(answers)} skipped as done by an earlier run"
    written = [_answer(json.loads(line)) for line in output.read_text().splitlines()]
    assert written == answers  # each line once, in input order across the runs
