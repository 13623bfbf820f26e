"""The schema suite (scripts/benches/schema_suite.py) through the real engine on the tiny
model: every schema compiles, every answer that stops is valid under its schema (checked
by the `jsonschema` library, formats included), schemas drawn by hypothesis too, and what
llguidance does not implement is an invalid_request that names it."""

import json

import jsonschema
import pytest
from conftest import load_script
from enginekit import generate, submit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbatch.errors import INVALID_REQUEST, CbatchError

schema_suite = load_script("benches/schema_suite")
LEAVES, REFUSED, suite = schema_suite.LEAVES, schema_suite.REFUSED, schema_suite.suite

MAX_TOKENS = 256
# The tiny model's random weights write valid JSON only where the constraint leads them,
# and end only where a string or a number happens to close in time: most answers stop.
MIN_STOPPED_SHARE = 0.5


def check_answers(schemas: list[dict], results) -> int:
    """Asserts each stopped answer is valid under its schema; returns how many stopped."""
    checker = jsonschema.FormatChecker()
    num_stopped = 0
    for schema, result in zip(schemas, results):
        assert result.finish_reason in ("stop", "length"), (schema, result.finish_reason)
        if result.finish_reason == "stop":
            num_stopped += 1
            jsonschema.validate(json.loads(result.text), schema, format_checker=checker)
    return num_stopped


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from cbatch.config import EngineConfig
    from cbatch.workers.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=tiny_model_path, parallel=16, ctx_size=16 * 512, batch_size=256))
    yield engine
    engine.close()


def test_the_suite_has_two_hundred_schemas_that_each_compile(engine):
    from cbatch.params import parse_params

    schemas = suite()
    assert len(schemas) >= 200 and len({json.dumps(s) for s in schemas}) >= 200
    for schema in schemas:
        engine.structured.compiler.matcher(parse_params({"json_schema": schema}))
    assert len(engine.structured.compiler.compile_s) >= 200


def test_every_stopped_answer_is_valid_under_its_schema(engine):
    schemas = suite()
    bodies = [{"prompt": f"JSON {i}:", "json_schema": schema, "max_tokens": MAX_TOKENS, "temperature": 0.8,
               "seed": i} for i, schema in enumerate(schemas)]
    results = generate(engine, bodies)
    num_stopped = check_answers(schemas, results)
    assert num_stopped >= MIN_STOPPED_SHARE * len(schemas), f"only {num_stopped} of {len(schemas)} stopped"


def test_greedy_answers_are_valid_too(engine):
    schemas = suite()[:40]
    results = generate(engine, [{"prompt": "x", "json_schema": s, "max_tokens": MAX_TOKENS, "temperature": 0}
                                for s in schemas])
    check_answers(schemas, results)


def _schemas(children):
    objects = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3).map(
        lambda properties: {"type": "object", "properties": properties, "required": sorted(properties),
                            "additionalProperties": False})
    arrays = st.tuples(children, st.integers(0, 3)).map(
        lambda pair: {"type": "array", "items": pair[0], "maxItems": pair[1]})
    return objects | arrays | st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options})


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=st.recursive(st.sampled_from(LEAVES), _schemas, max_leaves=6), seed=st.integers(0, 1000))
def test_drawn_schemas_give_valid_answers(engine, schema, seed):
    (result,) = generate(engine, [{"prompt": "x", "json_schema": schema, "max_tokens": MAX_TOKENS, "seed": seed}])
    check_answers([schema], [result])


@pytest.mark.parametrize("schema, feature", REFUSED)
def test_a_feature_llguidance_lacks_is_refused_by_name(engine, schema, feature):
    with pytest.raises(CbatchError) as caught:
        submit(engine, {"prompt": "x", "json_schema": schema})
    assert caught.value.code == INVALID_REQUEST and feature in caught.value.message
    assert "json_schema" in caught.value.message
