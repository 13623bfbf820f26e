"""How a model writes its calls, read back and forced by a grammar.

- JSON_ANSWER: cbatch's own, taught in a system message to models whose chat template
  knows no tools: the whole answer is `{"tool_calls": [{"name", "arguments"}, ...]}`.
- TAGGED (Hermes, Qwen and the like): `<tool_call>{"name", "arguments"}</tool_call>`,
  one block per call, maybe after some text.
- BareJson (Llama 3.1 and the like): the whole answer is one `{"name", "arguments"}` (or
  "parameters", as the template says).

A forced call travels as its format's `name` and the allowed functions' parameter
schemas (ToolPlan.constraint); the decode worker builds the grammar, the format's own text
around each call, whose arguments are that function's parameter schema, so a forced
call's arguments always match their schema (workers/engine/structured/tool_grammar.py).
"""

import json
import re

from cbatch.partial_markers import partial_marker_len

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE = '{"tool_calls": [', "]}"  # JSON_ANSWER's text around its calls
NEWLINE = "\n"
_TAGGED_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def _arguments(value) -> dict | None:
    """A call's arguments as an object (some models write them as a JSON string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def _call(obj, functions: dict, keys: tuple[str, ...]) -> dict | None:
    """{"name", "arguments"} of a call object naming one of the functions, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in functions:
        return None
    arguments = _arguments(next((obj[key] for key in keys if key in obj), {}))
    return None if arguments is None else {"name": obj["name"], "arguments": arguments}


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class JsonAnswer:
    name = "json_answer"  # as a forced call names it on the wire (cbatch.params.ToolCall)
    arguments_key = "arguments"

    def parse(self, text: str, functions: dict) -> tuple[str, list[dict]] | None:
        answer = _json(text)
        items = answer.get("tool_calls") if isinstance(answer, dict) else None
        calls = [_call(item, functions, ("arguments",)) for item in items] if isinstance(items, list) else []
        return ("", calls) if calls and all(calls) else None

    def held_from(self, text: str, is_start: bool) -> int:
        """Where in the not yet released text a call may begin: only the whole answer is one."""
        return 0 if is_start and (not text.strip() or text.lstrip().startswith("{")) else len(text)


class BareJson(JsonAnswer):
    name = "bare_json"  # one call: the format has no room for more

    def __init__(self, arguments_key: str):
        self.arguments_key = arguments_key

    def parse(self, text: str, functions: dict) -> tuple[str, list[dict]] | None:
        answer = _json(text)
        items = answer if isinstance(answer, list) else [answer]
        calls = [_call(item, functions, ("arguments", "parameters")) for item in items]
        return ("", calls) if calls and all(calls) else None


class Tagged(BareJson):
    """Each call in its own `<tool_call>` block; a bare JSON call is taken too."""

    name = "tagged"

    def __init__(self):
        super().__init__("arguments")

    def parse(self, text: str, functions: dict) -> tuple[str, list[dict]] | None:
        blocks = _TAGGED_CALL.findall(text)
        if not blocks:
            return super().parse(text, functions)
        calls = [_call(_json(block.strip()), functions, ("arguments", "parameters")) for block in blocks]
        return (_TAGGED_CALL.sub("", text).strip(), calls) if all(calls) else None

    def held_from(self, text: str, is_start: bool) -> int:
        """From a `<tool_call>` on (to the end: the blocks are parsed whole), or from a tail
        that may become one; the whole answer when it may be a bare JSON call."""
        if super().held_from(text, is_start) == 0:
            return 0
        at = text.find(TOOL_CALL_OPEN)
        if at >= 0:
            return at
        return len(text) - partial_marker_len(text, TOOL_CALL_OPEN)


JSON_ANSWER = JsonAnswer()


def format_of(welcome: dict | None) -> JsonAnswer | None:
    """The call format the daemon's handshake names (`tool_format`: its model's chat
    template knows tools and teaches it); None when it names none: cbatch's own format is
    then taught in words."""
    spec = (welcome or {}).get("tool_format")
    if not isinstance(spec, dict):
        return None
    if spec.get("name") == Tagged.name:
        return Tagged()
    if spec.get("name") == BareJson.name and spec.get("arguments_key") in ("arguments", "parameters"):
        return BareJson(spec["arguments_key"])
    return None
