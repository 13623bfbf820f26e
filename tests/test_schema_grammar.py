"""JSON schemas made into grammars (cbatch/tools/schema_grammar.py), without a daemon: the
grammars parse in llama.cpp (the tiny model's vocabulary), bounds are written as
repetitions up to llama.cpp's limit, and what is past a limit is refused at once with an
invalid_request naming the field, on every way in: response_format, tools over HTTP and
in batch files (parse_api_request), native clients' tools (prepare_request). The HTTP
server's event loop is tested in test_http_schema_bounds.py."""

import re
import time

import pytest

from cbatch.errors import CbatchError
from cbatch.openai.mapping import CHAT, parse_api_request
from cbatch.tools import tool_plan
from cbatch.tools.chat import prepare_request
from cbatch.tools.formats import BareJson, Tagged
from cbatch.tools.integer_ranges import integer_range
from cbatch.tools.schema_grammar import MAX_GRAMMAR_REPETITIONS, MAX_REPETITION_BOUND, SchemaFields

CITY = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": CITY}} for name in ("get_weather", "get_time")]
ASK = [{"role": "user", "content": "hi"}]
REFUSED_AT_ONCE_S = 1.0  # a refusal is a walk of the schema, nothing converted


@pytest.fixture(scope="module")
def parses(tiny_model_path):
    """Whether llama.cpp's own parser takes a grammar (as the decode worker starts it)."""
    import llama_cpp.llama_cpp as lc

    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(tiny_model_path.encode(), params)
    vocab = lc.llama_model_get_vocab(model)

    def parse(grammar: str) -> bool:
        sampler = lc.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if sampler:
            lc.llama_sampler_free(sampler)
        return bool(sampler)

    yield parse
    lc.llama_model_free(model)


def schema_grammar(schema: dict) -> str:
    schemas = SchemaFields()
    return schemas.grammar(schemas.checked(schema, "schema"), "schema")


def refusal(raw: dict) -> str:
    started = time.monotonic()
    with pytest.raises(CbatchError) as caught:
        parse_api_request(CHAT, {"messages": ASK, **raw}, ["m"])
    assert time.monotonic() - started < REFUSED_AT_ONCE_S
    assert caught.value.code == "invalid_request"
    return caught.value.message


def answer_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def tool_with(parameters: dict) -> dict:
    return {"tools": [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": "required"}


def test_the_parser_check_sees_a_bad_grammar(parses):
    """Control: llama.cpp refuses these, so a True below means something."""
    assert not parses("root ::= (") and not parses('root ::= "a"{3000}')
    assert not parses('root ::= ("a" b{0,1999})?\nb ::= "b"')  # a repeated group's rules count against its limit


@pytest.mark.parametrize("call_format", [Tagged(), BareJson("arguments")])
@pytest.mark.parametrize("extra", [{"tool_choice": "required"},
                                   {"tool_choice": "required", "parallel_tool_calls": False},
                                   {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}])
def test_forced_call_grammars_parse_in_llama_cpp(parses, call_format, extra):
    grammar = tool_plan({"tools": TOOLS, **extra}, call_format).grammar()
    assert parses(grammar)
    assert ("<tool_call>" in grammar) == isinstance(call_format, Tagged)


@pytest.mark.parametrize("low, high", [(0, None), (0, 0), (0, 1), (1, None), (3, 10), (0, MAX_REPETITION_BOUND),
                                       (MAX_REPETITION_BOUND, MAX_REPETITION_BOUND)])
def test_string_and_array_bounds_are_repetitions_llama_cpp_takes(parses, low, high):
    """Up to llama.cpp's own limit, whatever the rules' names' order (a property "a" sorts
    before the "char" rule it repeats)."""
    def bounded(kind: str, names: tuple[str, str], **extra) -> dict:
        return {"type": kind, names[0]: low, **({names[1]: high} if high is not None else {}), **extra}

    grammar = schema_grammar({"type": "object", "properties": {
        "a": bounded("string", ("minLength", "maxLength")),
        "b": bounded("array", ("minItems", "maxItems"), items={"type": "integer"})}})
    assert parses(grammar)
    assert f"char{{{low},{'' if high is None else high}}}" in grammar
    assert len(grammar) < 1000  # a bound's size does not show in the grammar's


@pytest.mark.parametrize("raw, named", [
    (answer_format({"type": "object", "properties": {"text": {"type": "string", "maxLength": 100_000_000}}}),
     "response_format.json_schema.schema.properties.text.maxLength is 100000000; at most 2000"),
    (answer_format({"type": "object", "properties": {"text": {"type": "string", "maxLength": 1e8}}}),
     "response_format.json_schema.schema.properties.text.maxLength is 100000000.0; at most 2000"),
    (answer_format({"type": "string", "minLength": 100_000}), "response_format.json_schema.schema.minLength is 100000"),
    (tool_with({"type": "object", "properties": {"tags": {"type": "array", "maxItems": 10 ** 7}}}),
     "tools[2].function.parameters.properties.tags.maxItems is 10000000"),
    (tool_with({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[0-9]{5000}$"}}}),
     "tools[2].function.parameters.properties.code.pattern's {5000} is 5000"),
    (tool_with({"type": "string", "maxLength": '5} | [^"]{0,'}), "tools[2].function.parameters.maxLength must be"),
    (tool_with({"type": "string", "minLength": 5, "maxLength": 3}),
     "tools[2].function.parameters.minLength is more than its maxLength"),
    (answer_format({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": MAX_REPETITION_BOUND}
                                                     for i in range(MAX_GRAMMAR_REPETITIONS // MAX_REPETITION_BOUND + 1)}}),
     f"properties.p4.maxLength takes the repetitions the schemas' grammar allows to 10000; at most "
     f"{MAX_GRAMMAR_REPETITIONS}"),
    (answer_format({"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{1,100}$"}}}),
     "response_format.json_schema.schema.properties.zip nests its grammar's groups 99 deep; at most 64"),
    (answer_format({"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(2000)}}),
     "response_format.json_schema.schema makes a grammar of more than 16384 characters"),
    (answer_format({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
     "response_format.json_schema.schema cannot be converted to a grammar"),
])
def test_what_is_past_a_limit_is_refused_at_once_naming_the_field(raw, named):
    assert named in refusal(raw)


def test_a_property_named_like_a_bound_is_a_property():
    grammar = schema_grammar({"type": "object", "properties": {"maxLength": {"type": "integer", "minimum": 1,
                                                                             "maximum": 3}}})
    assert "maxLength ::= ([1-3]) space" in grammar


def test_a_native_clients_tools_are_bounded_too():
    body = {"messages": ASK, **tool_with({"type": "object", "properties": {"t": {"type": "string",
                                                                                "maxLength": 10 ** 8}}})}
    started = time.monotonic()
    with pytest.raises(CbatchError, match=r"tools\[2\]\.function\.parameters\.properties\.t\.maxLength is 100000000"):
        prepare_request(body, None)
    assert time.monotonic() - started < REFUSED_AT_ONCE_S


BOUNDS = [None, -1001, -120, -10, -1, 0, 1, 9, 10, 17, 99, 100, 342, 5003]
RANGES = [(low, high) for low in BOUNDS for high in BOUNDS if low is None or high is None or low <= high]


def test_an_integer_range_allows_exactly_its_json_integers():
    """Every integer range, one-sided ones too, checked value by value around its bounds:
    GBNF's literals, classes, groups and repetitions read as a regular expression."""
    for low, high in RANGES:
        allows = re.compile(integer_range(low, high).replace('"', "").replace(" ", "")).fullmatch
        for number in range(-6000, 6000):
            is_in_range = (low is None or number >= low) and (high is None or number <= high)
            assert bool(allows(str(number))) == is_in_range, (low, high, number)
        assert not any(allows(text) for text in ("-0", "01", "-", "", "1" * 17)), (low, high)


def test_integer_bounds_become_a_grammar_llama_cpp_takes(parses):
    """Of any width, on one side only, exclusive: the converter ignores them all."""
    grammar = schema_grammar({"type": "object", "properties": {
        "age": {"type": "integer", "maximum": 120}, "id": {"type": "integer", "minimum": 0, "maximum": 10 ** 6},
        "odd": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3},
        "low": {"type": "integer", "minimum": -5}, "ratio": {"type": "number", "maximum": 1}}})
    assert parses(grammar)
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert rules["age"] == f"({integer_range(None, 120)}) space" and rules["odd"] == "([1-2]) space"
    assert rules["id"] == f"({integer_range(0, 10 ** 6)}) space"
    assert rules["low"] == f"({integer_range(-5, None)}) space"
    assert rules["ratio-kv"].endswith(" number")  # a number's bounds are the converter's (it ignores them)


def test_bounds_that_are_not_whole_round_inward_and_draft_4_flags_make_them_exclusive():
    grammar = schema_grammar({"type": "object", "properties": {
        "half": {"type": "integer", "minimum": 1.5, "maximum": 100.0},
        "flagged": {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 9, "exclusiveMaximum": True},
        "unflagged": {"type": "integer", "minimum": 0, "exclusiveMinimum": False},
        "huge": {"type": "integer", "maximum": 10 ** 30}}})
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert rules["half"] == f"({integer_range(2, 100)}) space"
    assert rules["flagged"] == f"({integer_range(1, 8)}) space"
    assert rules["unflagged"] == f"({integer_range(0, None)}) space"
    assert rules["huge"] == f"({integer_range(None, 10 ** 16 - 1)}) space"  # the longest integer written


@pytest.mark.parametrize("bounds", [{"minimum": 1.5, "maximum": 1.7}, {"minimum": 10 ** 20},
                                    {"exclusiveMinimum": 5, "exclusiveMaximum": 6}])
def test_bounds_with_no_integer_between_them_are_refused(bounds):
    assert "properties.n's bounds leave no integer" in refusal(answer_format({
        "type": "object", "properties": {"n": {"type": "integer", **bounds}}}))


def test_an_empty_integer_range_is_refused():
    assert "properties.n's bounds leave no integer" in refusal(answer_format({
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "exclusiveMaximum": 5}}}))
