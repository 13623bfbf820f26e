"""cbatch's own batch files: one request per line, {"id", "prompt" or "messages",
params...}; one result line per input line: {"id", "text", "finish_reason", "usage"}, or
{"id", "usage", "choices": [...]} for a line with `n`, or {"id", "error"}. A line with
`tools` gets "tool_calls" (OpenAI's shape) beside "text" when the model called. A line
that is not a request of its own gets its line number as id, and `line` in its error."""

from cbatch.batch.line_keys import line_error
from cbatch.client.streams import Completion, completion_from_chunks
from cbatch.errors import CbatchError
from cbatch.openai.choices import expand_choices
from cbatch.params import BATCH, parse_request
from cbatch.tools.chat import prepare_request


def _answer(completion: Completion) -> dict:
    """text and finish_reason, and the calls read from the text when the line offered tools."""
    calls = {"tool_calls": completion.tool_calls} if completion.tool_calls else {}
    return {"text": completion.text, "finish_reason": completion.finish_reason, **calls}


def check_body(body: dict) -> None:
    """Refuse a request body as the daemon would: by its own parsing (cbatch.params), after
    any tools are made part of the request as the ZeroMQ client makes them (with no call
    format named: the tools are checked and described in words)."""
    request = {name: value for name, value in body.items() if name != "id"}
    parse_request(1, prepare_request(request, None)[0])


class NativeLine:
    """One input line's choices as they complete (several with `n`). `checks_bodies`: the
    requests go where the daemon's checks do not reach them (over HTTP, where any other
    server may ignore what it does not know), so they are checked here, and a line that
    fails them has the verdict it has over ZeroMQ."""

    def __init__(self, number: int, item, checks_bodies: bool = False):
        self.id = item.get("id") if isinstance(item, dict) else number
        self.has_n = isinstance(item, dict) and "n" in item
        self.bodies: list[dict] = []
        self.result: dict | None = None
        self._chunks: dict[int, list] = {}  # choice -> chunks so far
        self._ended: dict[int, Completion | CbatchError] = {}  # choice -> how it ended
        if isinstance(item, CbatchError):
            self.result = {"id": self.id, "error": line_error(item, number)}
            return
        try:
            # A batch file's lines yield to interactive requests unless a line says otherwise.
            bodies = expand_choices({"priority": BATCH, **item})
            if checks_bodies:
                for body in bodies:
                    check_body(body)
            self.bodies = bodies
        except CbatchError as err:
            self.result = {"id": self.id, "error": err.to_dict()}

    @property
    def is_ok(self) -> bool:
        return "error" not in self.result

    def add(self, choice: int, chunk) -> None:
        if isinstance(chunk, CbatchError):
            self._ended[choice] = chunk
        else:
            self._chunks.setdefault(choice, []).append(chunk)
            if chunk.finish_reason:
                self._ended[choice] = completion_from_chunks(self._chunks.pop(choice))
        if len(self._ended) == len(self.bodies):
            self.result = self._output()

    def _output(self) -> dict:
        errors = [r for r in self._ended.values() if isinstance(r, CbatchError)]
        if errors:
            return {"id": self.id, "error": errors[0].to_dict()}
        choices = [self._ended[i] for i in range(len(self.bodies))]
        if not self.has_n:
            c = choices[0]
            return {"id": self.id, **_answer(c), "usage": c.usage}
        usage = {"prompt_tokens": choices[0].usage["prompt_tokens"],
                 "completion_tokens": sum(c.usage["completion_tokens"] for c in choices)}
        return {"id": self.id, "usage": usage, "choices": [
            {"index": i, **_answer(c), "usage": c.usage}
            for i, c in enumerate(choices)]}
