"""OpenAI batch files for cbatch-submit, and `--resume` for any input file.

Input lines: {"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body"}. Output lines, in input order: {"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}. A request that fails has
the OpenAI error object as its response body and its HTTP status; a line that is not a
request at all has `response: null` and `error: {"code", "message"}`.
"""

import json
import os
import time
import uuid

from cbatch.errors import CbatchError, INVALID_REQUEST
from cbatch.openai_api import CHAT, COMPLETION, ResponseBuilder, WholeResponse, error_body, error_status, \
    parse_api_request
from cbatch.wording import counted

URL_KINDS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


def is_openai_batch(numbered_items) -> bool:
    """The file is an OpenAI batch file when its first line that is a JSON object has a
    `custom_id` (lines before it that do not parse say nothing about the file)."""
    for _number, item in numbered_items:
        if isinstance(item, dict):
            return "custom_id" in item
    return False


def id_key(item) -> str:
    """The JSON text of a line's id (ids may be any JSON value)."""
    return json.dumps(item.get("custom_id", item.get("id")), sort_keys=True)


def prepare_resume(output_path: str) -> set[str]:
    """Ids of the lines an earlier run already wrote to `output_path`. A last line cut by
    an interruption is removed, so appending continues the file cleanly."""
    if not os.path.exists(output_path):
        return set()
    with open(output_path, "rb+") as out:
        data = out.read()
        complete = data[:data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            out.truncate(len(complete))
    ids = set()
    for line in complete.decode("utf-8", errors="replace").splitlines():
        try:
            ids.add(id_key(json.loads(line)))
        except (json.JSONDecodeError, AttributeError):
            continue  # not a result line: it will not match any input
    return ids


def _line_failure(custom_id, err: CbatchError) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": err.code, "message": err.message}}


def _request_failure(custom_id, err: CbatchError) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": error_status(err.code), "request_id": uuid.uuid4().hex,
                         "body": error_body(err)}, "error": None}


class _Line:
    """One input line: its parsed request, or why it cannot run, and its result so far."""

    def __init__(self, number: int, item):
        self.custom_id = item.get("custom_id") if isinstance(item, dict) else None
        self.bodies: list[dict] = []
        self.whole: WholeResponse | None = None
        self.result: dict | None = None
        try:
            if isinstance(item, CbatchError):
                raise item
            if not isinstance(self.custom_id, str) or not isinstance(item.get("body"), dict):
                raise CbatchError(INVALID_REQUEST, f"line {number} needs a string custom_id and an object body")
            kind = URL_KINDS.get(item.get("url"))
            if kind is None or item.get("method", "POST") != "POST":
                raise CbatchError(INVALID_REQUEST, f"line {number}: url must be one of {sorted(URL_KINDS)} with POST")
        except CbatchError as err:
            self.result = _line_failure(self.custom_id, err)
            return
        try:
            request = parse_api_request(kind, {**item["body"], "stream": False}, None)
        except CbatchError as err:
            self.result = _request_failure(self.custom_id, err)
            return
        self.bodies = request.bodies
        self.whole = WholeResponse(ResponseBuilder(request, str(item["body"].get("model", ""))))

    def add(self, choice: int, chunk) -> None:
        if self.result is not None:
            return  # already failed: the other choices' chunks are dropped
        if isinstance(chunk, CbatchError):
            self.result = _request_failure(self.custom_id, chunk)
            return
        self.whole.add(choice, chunk)
        if not self.whole.num_left:
            response = self.whole.response()
            self.result = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": self.custom_id, "error": None,
                           "response": {"status_code": 200, "request_id": response["id"], "body": response}}

    @property
    def is_ok(self) -> bool:
        return self.result["error"] is None and self.result["response"]["status_code"] == 200


def run_openai_batch(client, numbered_items, out, max_in_flight: int) -> dict:
    """Run the lines through the daemon (at most max_in_flight requests outstanding) and
    write one output line per input line, in input order."""
    lines: list[_Line | None] = []
    owners: list[tuple[int, int]] = []  # batch position -> (line, choice)
    next_to_write = num_failed = num_tokens = 0
    started = time.monotonic()

    def items():
        for number, item in numbered_items:
            lines.append(_Line(number, item))
            for choice, body in enumerate(lines[-1].bodies):
                owners.append((len(lines) - 1, choice))
                yield body

    def write_ready():
        nonlocal next_to_write, num_failed
        num_written = next_to_write
        while next_to_write < len(lines) and lines[next_to_write].result is not None:
            line = lines[next_to_write]
            num_failed += not line.is_ok
            out.write(json.dumps(line.result, ensure_ascii=False) + "\n")
            lines[next_to_write] = None  # written: keep no more of it
            next_to_write += 1
        if next_to_write > num_written:
            out.flush()  # what is written survives an interruption, for --resume

    for position, chunk in client.stream_batch(items(), max_in_flight):
        line_index, choice = owners[position]
        lines[line_index].add(choice, chunk)
        num_tokens += len(getattr(chunk, "token_ids", ()))
        write_ready()
    write_ready()  # lines with no request (bad lines at the end)
    out.flush()
    elapsed = time.monotonic() - started
    return {"num_failed": num_failed, "line": (
        f"cbatch-submit: {counted(next_to_write, 'OpenAI batch line')}, {next_to_write - num_failed} ok, "
        f"{num_failed} failed; {counted(num_tokens, 'token')} in {elapsed:.1f} s "
        f"({num_tokens / max(elapsed, 1e-9):.1f} tok/s)")}
