"""A request whose decode failed, as every consumer reports it: an error with code
decode_failed and the worker's reason, never a completion with finish_reason "error".

A real daemon cannot be made to fail a decode on demand (the KV manager keeps room for
every batch), so a scripted front-end on a real socket sends what the daemon sends for
one: the tokens produced so far, then a finish with reason "error" and the worker's
message. Everything on the client's side is real: its sockets, its processes."""

import asyncio
import json
import subprocess

import pytest
from daemonkit import SCRIPTS_DIR, ScriptedFrontEnd

from cbatch.client import Client
from cbatch.client.async_client import AsyncClient
from cbatch.client.streams import Chunk
from cbatch.errors import DECODE_FAILED, CbatchError
from cbatch.ipc.records import TokenEvent
from cbatch.protocol import MsgType

REASON = "llama_decode failed with status -3"


def answer(request_id: int, body: dict) -> list:
    """A prompt containing "fail" fails after one token; any other finishes after one."""
    fails = "fail" in body.get("prompt", "") or "fail" in json.dumps(body.get("messages", []))
    records = TokenEvent(request_id, [9], "z", "error" if fails else "length").records()
    rows = [[r.index, r.token_id, r.flags, r.finish, r.count, r.text] for r in records]
    return [(MsgType.RECORDS, {"request_id": request_id, "records": rows}),
            (MsgType.FINISHED, {"request_id": request_id, "finish_reason": "error" if fails else "length",
                                "usage": {"prompt_tokens": 1, "completion_tokens": 1}, "num_records": len(records),
                                "error": REASON if fails else None})]


@pytest.fixture
def front_end():
    with ScriptedFrontEnd(answer) as front_end:
        yield front_end


def submit(front_end, tmp_path, lines: list[dict]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(tmp_path / "in.jsonl"), "-o",
                          str(tmp_path / "out.jsonl")], env=front_end.env, capture_output=True, text=True, timeout=60)
    return run, [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]


def test_submit_writes_an_error_line_for_a_failed_decode_and_exits_1(front_end, tmp_path):
    run, out = submit(front_end, tmp_path, [{"id": "bad", "prompt": "fail here"}, {"id": "good", "prompt": "fine"},
                                            {"id": "n", "prompt": "fail too", "n": 2}])
    assert run.returncode == 1, run.stderr
    assert out[0] == {"id": "bad", "error": {"code": DECODE_FAILED, "message": REASON}}
    assert out[1]["text"] == "z" and out[1]["finish_reason"] == "length"
    assert out[2] == {"id": "n", "error": {"code": DECODE_FAILED, "message": REASON}}
    assert "1 ok, 2 failed" in run.stderr


def test_openai_batch_answers_a_failed_decode_with_a_500_error_response(front_end, tmp_path):
    def line(custom_id, prompt):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                "body": {"model": "m", "prompt": prompt}}

    run, out = submit(front_end, tmp_path, [line("bad", "fail here"), line("good", "fine")])
    assert run.returncode == 1, run.stderr
    bad, good = out
    assert bad["custom_id"] == "bad" and bad["error"] is None and bad["response"]["status_code"] == 500
    assert bad["response"]["body"]["error"] == {"message": REASON, "type": "server_error", "param": None,
                                                "code": DECODE_FAILED}
    assert good["response"]["status_code"] == 200 and good["response"]["body"]["choices"][0]["text"] == "z"
    assert "1 ok, 1 failed" in run.stderr


def test_both_clients_raise_the_workers_reason(front_end):
    with Client(front_end.endpoint) as client:
        with pytest.raises(CbatchError) as err:
            client.generate(prompt="fail here")
        assert (err.value.code, err.value.message) == (DECODE_FAILED, REASON)
        (_, first), (_, last) = client.stream_batch(["fail here"])
        assert isinstance(first, Chunk) and first.token_ids == [9] and last.code == DECODE_FAILED
        bad, good = client.generate_batch(["fail here", "fine"])
        assert (bad.code, bad.message) == (DECODE_FAILED, REASON) and good.text == "z"

    async def main():
        async with await AsyncClient.connect(front_end.endpoint) as client:
            with pytest.raises(CbatchError) as err:
                await client.generate(prompt="fail here")
            assert (err.value.code, err.value.message) == (DECODE_FAILED, REASON)
            bad, good = await client.generate_batch(["fail here", "fine"])
            assert (bad.code, bad.message) == (DECODE_FAILED, REASON) and good.text == "z"

    asyncio.run(main())
