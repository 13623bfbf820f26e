"""cbatch-submit with OpenAI batch files through a real daemon: mixed good and bad lines,
and --resume after a run killed mid-file."""

import json
import signal
import subprocess
import time

from daemonkit import SCRIPTS_DIR


def _line(custom_id, body, url="/v1/completions"):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _submit(daemon, *args, **popen):
    return subprocess.Popen([str(SCRIPTS_DIR / "cbatch-submit"), *args], env=daemon.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def test_openai_batch_mixed_lines(start_daemon, tiny_model_path, tmp_path):
    daemon = start_daemon(tiny_model_path, "--alias", "m")  # the lines' model, as the HTTP API would take it
    lines = [  # a first line that does not parse does not make the file a native one
        "{not json",
        # both choices are rejected by the daemon: the line fails once, the next lines still run
        _line("two-bad", {"model": "m", "prompt": "hey " * 5000, "n": 2}),
        _line("ok", {"model": "m", "prompt": "hello", "max_tokens": 5, "temperature": 0}),
        _line("bad-url", {"prompt": "x"}, url="/v1/moderations"),
        _line("bad-value", {"model": "m", "prompt": "x", "temperature": -1}),
        _line("two", {"model": "m", "prompt": "hey", "max_tokens": 3, "n": 2, "seed": 1}),
        _line("no-template", {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
              url="/v1/chat/completions"),
        _line("unserved", {"model": "gpt-4", "prompt": "x"}),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    process = _submit(daemon, str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"))
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1, stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [None, "two-bad", "ok", "bad-url", "bad-value", "two", "no-template",
                                            "unserved"]
    assert "8 OpenAI batch lines written, 2 ok, 6 failed; 11 tokens in" in stderr
    assert out[1]["response"]["status_code"] == 400
    assert out[1]["response"]["body"]["error"]["code"] == "prompt_too_long"
    out.pop(1)
    ok = out[1]["response"]
    assert out[1]["error"] is None and ok["status_code"] == 200
    assert ok["body"]["object"] == "text_completion" and ok["body"]["usage"]["completion_tokens"] == 5
    assert ok["body"]["model"] == "m" and ok["request_id"]
    assert out[0]["response"] is None and out[0]["error"]["code"] == "invalid_request"
    assert out[2]["response"] is None and "url" in out[2]["error"]["message"]
    assert out[3]["response"]["status_code"] == 400
    assert out[3]["response"]["body"]["error"]["param"] == "temperature"
    assert [c["index"] for c in out[4]["response"]["body"]["choices"]] == [0, 1]
    assert out[5]["response"]["status_code"] == 400 and "template" in out[5]["response"]["body"]["error"]["message"]
    unserved = out[6]["response"]
    assert unserved["status_code"] == 404 and unserved["body"]["error"]["code"] == "not_found"
    assert "'tiny-llama.gguf', 'm'" in unserved["body"]["error"]["message"]
    assert ok["body"]["system_fingerprint"].startswith("fp_")


def test_resume_after_a_killed_run_finishes_every_line_once(start_daemon, tiny_model_path, tmp_path):
    daemon = start_daemon(tiny_model_path, "--parallel", "2", "--alias", "m")
    ids = [f"req-{i}" for i in range(16)]
    body = {"model": "m", "prompt": "go", "max_tokens": 300, "ignore_eos": True}
    (tmp_path / "in.jsonl").write_text("".join(_line(i, body) + "\n" for i in ids))
    output = tmp_path / "out.jsonl"
    process = _submit(daemon, str(tmp_path / "in.jsonl"), "-o", str(output), "--max-in-flight", "2")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not output.exists() or output.read_text().count("\n") < 3):
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    with output.open("a") as out:
        out.write('{"id": "batch_req_cut", "custom_id": "req-1')  # a line cut by the interruption
    num_before = output.read_text().count("\n")
    assert 3 <= num_before < len(ids)
    process = _submit(daemon, str(tmp_path / "in.jsonl"), "-o", str(output), "--resume")
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    out = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(ids)
    assert [o["custom_id"] for o in out] == ids  # the first run wrote in order, the resumed one appends in order
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 300 for o in out)
    assert f"{len(ids) - num_before} OpenAI batch lines" in stderr
