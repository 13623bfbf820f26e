"""A forced call's grammar in llguidance's Lark, built here from the request's tool_call
(cbatch.params.ToolCall): the call format's text around a choice of calls, each call the
function's name and its arguments, which are that function's own parameter schema as a
JSON document of its own (`%json`), so `$ref`s within it resolve against it as they would
alone. Every call is written `{"name": "<name>", "<arguments key>": <arguments>}`, with
the separators JSON_OPTIONS gives the arguments themselves.

The formats (cbatch/tools/formats.py, which reads the calls back):
- json_answer: the whole answer is `{"tool_calls": [call, ...]}`.
- tagged: each call in its own `<tool_call>` block, the blocks a line apart.
- bare_json: the whole answer is one call: the format has no room for more.
"""

import json

from cbatch.constraints import JSON_OPTIONS
from cbatch.params import ToolCall
from cbatch.tools.formats import NEWLINE, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_CALLS_CLOSE, TOOL_CALLS_OPEN

LARK_HEADER = "%llguidance {}\n"


def lark_literal(text: str) -> str:
    """A Lark string literal (JSON's escapes, which llguidance's Lark reads)."""
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(tool_call: ToolCall) -> str:
    """The Lark of an answer that is a call (or calls) of the tool_call's functions."""
    if tool_call.format == "json_answer":
        more = "" if tool_call.is_one_call else f" ({lark_literal(', ')} call)*"
        start = f"{lark_literal(TOOL_CALLS_OPEN)} call{more} {lark_literal(TOOL_CALLS_CLOSE)}"
    elif tool_call.format == "tagged":
        block = f"{lark_literal(TOOL_CALL_OPEN + NEWLINE)} call {lark_literal(NEWLINE + TOOL_CALL_CLOSE)}"
        start = block + ("" if tool_call.is_one_call else f" ({lark_literal(NEWLINE)} {block})*")
    else:
        start = "call"
    return _call_grammar(start, tool_call.functions, tool_call.arguments_key)


def _call_grammar(start: str, functions: tuple[tuple[str, str], ...], arguments_key: str) -> str:
    """Lark whose `start` rule is given (it refers to `call`), with `call` one call of any
    of the functions, in their order."""
    rules = [f"start: {start}", "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, (name, parameters) in enumerate(functions):
        head = f'{{"name": {json.dumps(name)}, {json.dumps(arguments_key)}: '
        rules.append(f"call_{i}: {lark_literal(head)} arguments_{i} {lark_literal('}')}")
        rules.append(f"arguments_{i}: %json {_arguments_schema(parameters)}")
    return LARK_HEADER + "\n".join(rules) + "\n"


def _arguments_schema(parameters: str) -> str:
    """The schema (compact JSON, its objects closed where the request arrived) with cbatch's
    JSON writing options unless it sets its own."""
    return json.dumps({"x-guidance": JSON_OPTIONS, **json.loads(parameters)}, ensure_ascii=False,
                      separators=(",", ":"))
