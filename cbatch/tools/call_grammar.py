"""A forced call's grammar in llguidance's Lark: the call format's text around a choice of
calls, each call the function's name and its arguments, which are that function's own
parameter schema as a JSON document of its own (`%json`), so `$ref`s within it resolve
against it as they would alone. The decode worker compiles it (with its limits), so a
schema it cannot take is refused there, naming what it lacks.

Every call is written `{"name": "<name>", "<arguments key>": <arguments>}`, with the
separators JSON_OPTIONS gives the arguments themselves.
"""

import json

from cbatch.constraints import JSON_OPTIONS, closed_objects

LARK_HEADER = "%llguidance {}\n"  # marks the text as Lark for the worker (else it is read as GBNF)


def lark_literal(text: str) -> str:
    """A Lark string literal (JSON's escapes, which llguidance's Lark reads)."""
    return json.dumps(text, ensure_ascii=False)


def _arguments_schema(parameters: dict) -> str:
    """The schema as one line of JSON, its objects closed (cbatch.constraints), with cbatch's
    JSON writing options unless it sets its own."""
    return json.dumps({"x-guidance": JSON_OPTIONS, **closed_objects(parameters)}, ensure_ascii=False,
                      separators=(",", ":"))


def call_grammar(start: str, functions: dict[str, dict], arguments_key: str) -> str:
    """Lark whose `start` rule is given (it refers to `call`), with `call` one call of any
    of `functions` (name -> parameter schema), in their order."""
    rules = [f"start: {start}", "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, (name, parameters) in enumerate(functions.items()):
        head = f'{{"name": {json.dumps(name)}, {json.dumps(arguments_key)}: '
        rules.append(f"call_{i}: {lark_literal(head)} arguments_{i} {lark_literal('}')}")
        rules.append(f"arguments_{i}: %json {_arguments_schema(parameters)}")
    return LARK_HEADER + "\n".join(rules) + "\n"
