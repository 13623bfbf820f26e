"""OpenAI batch files for cbatch-submit.

Input lines: {"custom_id", "method": "POST", "url": "/v1/chat/completions",
"/v1/completions", "/v1/responses" or "/v1/embeddings", "body"}. Output lines, in input order: {"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}. A request that fails has
the OpenAI error object as its response body and its HTTP status; a line that is not a
request at all has `response: null` and `error: {"code", "message"}` (and `line`, its line
number, when it has no custom_id of its own: line_keys). An embeddings line is
embedded when it is read (its inputs in one request, batched by the daemon with whatever
else waits), while the completions before it run on.
"""

import uuid

from cbatch.batch.line_keys import LINE_FIELD
from cbatch.client.batch_retry import is_transient
from cbatch.errors import INVALID_REQUEST, CbatchError
from cbatch.openai.completions_output import ResponseBuilder, WholeResponse, system_fingerprint
from cbatch.openai.mapping import (
    CHAT,
    COMPLETION,
    embedding_response,
    error_body,
    error_status,
    parse_api_request,
    parse_embedding_request,
)
from cbatch.openai.responses_output import ResponseEvents, WholeResponseEvents, echoed_fields
from cbatch.openai.responses_request import parse_responses_request
from cbatch.params import BATCH

EMBEDDINGS, RESPONSES = "embeddings", "responses"
URL_KINDS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/embeddings": EMBEDDINGS,
             "/v1/responses": RESPONSES}


def is_openai_batch(numbered_items) -> bool:
    """The file is an OpenAI batch file when its first line that is a JSON object has a
    `custom_id` (lines before it that do not parse say nothing about the file)."""
    for _number, item in numbered_items:
        if isinstance(item, dict):
            return "custom_id" in item
    return False


def _line_failure(custom_id, err: CbatchError, number: int | None = None) -> dict:
    """A line that is not a request; `number` for one known by its line number."""
    line = {} if number is None else {LINE_FIELD: number}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": err.code, "message": err.message, **line}}


def _request_failure(custom_id, err: CbatchError) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": error_status(err.code), "request_id": uuid.uuid4().hex,
                         "body": error_body(err)}, "error": None}


def _kind_of(number: int, item: dict) -> str:
    """The line's kind of request, by its url; a line that is no request raises."""
    if not isinstance(item.get("body"), dict):
        raise CbatchError(INVALID_REQUEST, f"line {number} needs an object body")
    kind = URL_KINDS.get(item.get("url"))
    if kind is None or item.get("method", "POST") != "POST":
        raise CbatchError(INVALID_REQUEST, f"line {number}: url must be one of {sorted(URL_KINDS)} with POST")
    return kind


class OpenAILine:
    """One input line: its parsed request, or why it cannot run, and its result so far.
    `embed(inputs, dimensions)` computes an embeddings line's vectors (a client's embeddings,
    held through transient failures: one it raises means the run must stop); `reasoning` is
    the model's thinking tags, as the HTTP server splits answers by them; `forwards_tools`:
    the line goes to another OpenAI server, which takes its tools itself; `priority`: the
    priority every line runs at whatever its body says (a job's), None = `batch` unless the
    body says otherwise (a file the caller runs itself)."""

    def __init__(self, number: int, item, model_names: list[str], embed=None, tool_format=None, reasoning=None,
                 forwards_tools: bool = False, priority: str | None = None):
        self.custom_id = item.get("custom_id") if isinstance(item, dict) else None
        self.bodies: list[dict] = []
        self.whole: WholeResponse | WholeResponseEvents | None = None
        self.result: dict | None = None
        if isinstance(item, CbatchError):  # not JSON, no custom_id of its own (line_keys)
            self.result = _line_failure(None, item, number)
            return
        try:
            kind = _kind_of(number, item)
        except CbatchError as err:
            self.result = _line_failure(self.custom_id, err)
            return
        try:
            if kind == EMBEDDINGS:
                embedding_request = parse_embedding_request(item["body"], model_names)
                result = embed(embedding_request.inputs, embedding_request.dimensions)
                self._succeed(uuid.uuid4().hex,
                              embedding_response(embedding_request, result.data, result.prompt_tokens))
            else:
                self._parse(kind, item, model_names, tool_format, reasoning, forwards_tools, priority)
        except CbatchError as err:
            if is_transient(err):  # the embeddings were refused past the run's patience: the run stops
                raise
            self.result = _request_failure(self.custom_id, err)

    def _parse(self, kind: str, item: dict, model_names: list[str], tool_format, reasoning, forwards_tools: bool,
               priority: str | None) -> None:
        """A generation line's bodies, and what gathers its answer."""
        # A batch file's lines yield to interactive requests unless a body says otherwise;
        # a job's, whoever sent it, always do.
        body = {"priority": BATCH, **item["body"], "stream": False}
        if priority is not None:
            body["priority"] = priority
        if kind == RESPONSES:  # a chat request, answered in the Responses API's shapes
            request = parse_responses_request(body, model_names, reasoning, tool_format=tool_format)
            self.bodies = request.bodies
            self.whole = WholeResponseEvents(ResponseEvents(request, echoed_fields(item["body"])))
            return
        request = parse_api_request(kind, body, model_names, reasoning, tool_format=tool_format,
                                    forwards_tools=forwards_tools)
        self.bodies = request.bodies
        self.whole = WholeResponse(ResponseBuilder(request, system_fingerprint(model_names[0])))

    def add(self, choice: int, chunk) -> None:
        if self.result is not None:
            return  # already failed: the other choices' chunks are dropped
        if isinstance(chunk, CbatchError):
            self.result = _request_failure(self.custom_id, chunk)
            return
        self.whole.add(choice, chunk)
        if not self.whole.num_left:
            response = self.whole.response()
            self._succeed(response["id"], response)

    def _succeed(self, request_id: str, response: dict) -> None:
        self.result = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": self.custom_id, "error": None,
                       "response": {"status_code": 200, "request_id": request_id, "body": response}}

    @property
    def is_ok(self) -> bool:
        return self.result["error"] is None and self.result["response"]["status_code"] == 200
