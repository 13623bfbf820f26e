"""A constraint as it travels: a grammar's text, a JSON schema written out as compact
JSON, or a forced call (its format and its functions' parameter schemas, each as compact
JSON), checked where the request arrives (size, nesting, UTF-8) and compiled by the decode
worker (workers/engine/structured/), which builds every grammar. Nothing here needs
llguidance: a client-only install sends schemas too.

An object schema with `properties` and no `additionalProperties` takes no other
properties, as llama.cpp's server has it: a small model otherwise goes on writing
properties of its own. `"additionalProperties": true` allows them. Objects within an
`allOf` are left open, since closing each branch would refuse what the others add. A
number or integer schema without bounds of its own is bounded (MAX_INTEGER, MAX_NUMBER,
NUMBER_STEP), for the same reason.
"""

import json

from cbatch.text_checks import checked_text, invalid

MAX_CONSTRAINT_CHARS = 1 << 18  # of a grammar, or of a schema written out as JSON
MAX_SCHEMA_DEPTH = 120  # of a JSON schema's nesting, objects and arrays alike: llguidance compiles any this deep
# Numbers under a schema that bounds none: an integer of at most 16 digits (llama.cpp's own
# schema converter's bound), a number of at most 12 before the point and 6 after it
# (llguidance compiles a range with a step of at most 18 digits in all).
MAX_INTEGER = 10 ** 16 - 1
MAX_NUMBER, NUMBER_STEP = 10 ** 12 - 1, 1e-6
NUMBER_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
# How JSON under a schema is written: `, ` and `: ` between items, and whitespace bounded
# as llama.cpp's own schema grammars bound it (a small model otherwise may pad forever).
# llguidance's options; a schema's own "x-guidance" object overrides them.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ",
                "whitespace_pattern": r"(?:\x20|\n{1,2}[\x20\t]{0,20})?"}
# Keywords whose values are data, not schemas: never walked into.
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "x-guidance", "required"})
# Keywords whose values map names to schemas.
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def check_grammar(value) -> str | None:
    """GBNF or Lark text; whether it parses, and what it costs, the worker's compiler decides."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise invalid("grammar must be a non-empty string")
    return checked_text("grammar", value, MAX_CONSTRAINT_CHARS)


def schema_depth(value, limit: int) -> int:
    """How deep objects and arrays nest in `value`, counted up to `limit` + 1 at most."""
    depth, level = 0, [value]
    while level and depth <= limit:
        level = [item for node in level if isinstance(node, (dict, list, tuple))
                 for item in (node.values() if isinstance(node, dict) else node)]
        depth += 1
    return depth - (0 if level else 1)


def _each_schema(schema, fix, is_in_all_of: bool = False):
    """A copy of the schema with fix(copied schema, is_in_all_of) applied to it and to every
    schema within it, however deep; data keywords are left as they are."""
    if isinstance(schema, list):
        return [_each_schema(item, fix, is_in_all_of) for item in schema]
    if not isinstance(schema, dict):
        return schema
    copied = {}
    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            copied[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            copied[key] = {name: _each_schema(sub, fix, is_in_all_of) for name, sub in value.items()}
        else:
            copied[key] = _each_schema(value, fix, is_in_all_of or key == "allOf")
    fix(copied, is_in_all_of)
    return copied


def _close(schema: dict, is_in_all_of: bool) -> None:
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema and not is_in_all_of:
        schema["additionalProperties"] = False


def _require_all(schema: dict, is_in_all_of: bool) -> None:
    if isinstance(schema.get("properties"), dict):
        schema["required"] = list(schema["properties"])
        schema["additionalProperties"] = False


def _bound_numbers(schema: dict, is_in_all_of: bool) -> None:
    """Numbers of bounded digits (MAX_INTEGER, MAX_NUMBER, NUMBER_STEP) where a schema sets
    no bound of its own: a small model under a schema otherwise writes digits until
    max_tokens. A schema that sets any of NUMBER_BOUNDS is left as it is."""
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if NUMBER_BOUNDS & set(schema) or not {"integer", "number"} & types:
        return
    if "number" in types:
        schema.update(minimum=-MAX_NUMBER, maximum=MAX_NUMBER, multipleOf=NUMBER_STEP)
    else:
        schema.update(minimum=-MAX_INTEGER, maximum=MAX_INTEGER)


def _fixed_all(*fixes):
    def fix(schema: dict, is_in_all_of: bool) -> None:
        for each in fixes:
            each(schema, is_in_all_of)
    return fix


def closed_objects(schema):
    """The schema with its objects closed and its numbers bounded (see above); a copy, the
    caller's left as it is."""
    return _each_schema(schema, _fixed_all(_close, _bound_numbers))


def strict_objects(schema):
    """OpenAI's `strict: true`: every object's properties all required, none other allowed."""
    return _each_schema(schema, _require_all)


def check_json_schema(value) -> str | None:
    """A JSON schema object as compact JSON text, its objects closed: the wire and the
    worker's cache of compiled constraints key on it. Its keys keep the caller's order,
    which is the order an object's properties are generated in."""
    return None if value is None else _schema_text("json_schema", value)


def _schema_text(name: str, value) -> str:
    if not isinstance(value, dict):
        raise invalid(f"{name} must be a JSON schema object, got {type(value).__name__}")
    if schema_depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise invalid(f"{name} nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep")
    try:
        text = json.dumps(closed_objects(value), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as err:
        raise invalid(f"{name} is not JSON: {err}") from None
    return checked_text(name, text, MAX_CONSTRAINT_CHARS)


def check_tool_call(value) -> dict | None:
    """A forced call, `{"format", "functions": {name: parameter schema}, "arguments_key",
    "is_one_call"}`, with each schema as json_schema's compact text (`functions` becomes
    [name, text] pairs, in order); the schemas together within MAX_CONSTRAINT_CHARS. The
    other fields msgspec checks (params.ToolCall)."""
    if value is None:
        return None
    functions = value.get("functions") if isinstance(value, dict) else None
    if not isinstance(functions, dict) or not functions or not all(isinstance(name, str) for name in functions):
        raise invalid("tool_call must be an object whose functions map each name to its parameter schema")
    pairs = [[name, _schema_text(f"tool_call.functions.{name}", schema)] for name, schema in functions.items()]
    if sum(len(text) for _, text in pairs) > MAX_CONSTRAINT_CHARS:
        raise invalid(f"tool_call's parameter schemas are longer than {MAX_CONSTRAINT_CHARS} characters together")
    return {**value, "functions": pairs}
