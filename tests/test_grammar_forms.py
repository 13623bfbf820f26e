"""GBNF grammars as llguidance's converter turns them into Lark, and what cbatch puts back:
a repeated group of one repeated item keeps its parentheses (the converter drops them,
and Lark refuses `"a"{0,3}{0,3}`); an error in a converted grammar says it quotes the
converted text; and a schema as deep as the documented limit compiles."""

import pytest
from llguidance.gbnf_to_lark import gbnf_to_lark

from cbatch.constraints import MAX_SCHEMA_DEPTH, schema_depth
from cbatch.errors import CbatchError
from cbatch.params import parse_params
from cbatch.workers.engine.structured.compiler import regrouped


@pytest.mark.parametrize("gbnf, start", [
    ('root ::= ("a"{0,1000}){0,1000}', 'start: ("a"{0,1000}){0,1000}'),
    ('root ::= ([a-z]{2}){1,3}', "start: (/[a-z]/{2,2}){1,3}"),
    ('root ::= (("a"{2}){3}){4}', 'start: (("a"{2,2}){3,3}){4,4}'),
    ('root ::= "x{2}{3}"', 'start: "x{2}{3}"'),  # inside a string: text, left as it is
    ('root ::= ("ab" | "c"){2,4}', 'start: (("ab" | "c")){2,4}'),
])
def test_a_repeated_group_keeps_its_parentheses(gbnf, start):
    assert regrouped(gbnf_to_lark(gbnf)).splitlines()[-1] == start


def test_the_grammars_compile_and_a_converted_ones_error_says_it_was_converted(make_engine):
    compiler = make_engine().structured.compiler
    for grammar in ('root ::= ("a"{0,1000}){0,1000}', 'root ::= (("a"{2}){3}){4}'):
        compiler.matcher(parse_params({"grammar": grammar}))
    with pytest.raises(CbatchError) as refused:
        compiler.matcher(parse_params({"grammar": "root ::= [z-a]"}))
    assert refused.value.message.startswith("grammar (as llguidance's Lark, converted from GBNF)")


def test_a_schema_as_deep_as_the_limit_compiles(make_engine):
    """Objects within objects, and arrays within arrays, as deep as the stated limit allows."""
    compiler = make_engine().structured.compiler
    for wrap in (lambda inner: {"type": "object", "properties": {"a": inner}, "required": ["a"]},
                 lambda inner: {"type": "array", "items": inner}):
        schema = {"type": "string"}
        while schema_depth(wrap(schema), MAX_SCHEMA_DEPTH + 1) <= MAX_SCHEMA_DEPTH:
            schema = wrap(schema)
        assert schema_depth(schema, MAX_SCHEMA_DEPTH + 1) > MAX_SCHEMA_DEPTH - 3
        compiler.matcher(parse_params({"json_schema": schema}))
