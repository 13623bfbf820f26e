"""JSON schemas of the kinds real ones are made of, for the structured-output tests
(tests/test_schema_suite.py) and the structured-output bench: hand-written ones (records,
orders, events, recursive trees, tool parameters) and ones composed from the same parts by
a seeded generator, so the suite is the same on every run. Every schema here is one llguidance compiles; the ones
it refuses are in REFUSED, with the feature its 400 names."""

import json
import random

LEAVES = [
    {"type": "string", "maxLength": 12},
    {"type": "string", "minLength": 2, "maxLength": 6},
    {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "email", "maxLength": 40},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "ipv4"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "integer"},
    {"type": "integer", "minimum": 0, "maximum": 100},
    {"type": "integer", "minimum": -5, "exclusiveMaximum": 5},
    {"type": "integer", "minimum": 1000},
    {"type": "number"},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "exclusiveMinimum": -2.5, "maximum": 2.5},
    {"type": "boolean"},
    {"type": "null"},
    {"type": ["string", "null"], "maxLength": 10},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    {"enum": [1, 2, 3, "many", None]},
]

HAND_WRITTEN = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
     "properties": {"name": {"type": "string", "maxLength": 30},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                    "email": {"type": "string", "format": "email", "maxLength": 40}}},
    {"type": "object", "required": ["street", "city", "zip"],
     "properties": {"street": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"type": "string", "maxLength": 2}}},
    {"type": "object", "additionalProperties": False, "required": ["order_id", "items"],
     "properties": {"order_id": {"type": "string", "format": "uuid"},
                    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                        "type": "object", "additionalProperties": False, "required": ["sku", "quantity"],
                        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                       "quantity": {"type": "integer", "minimum": 1, "maximum": 9}}}},
                    "paid": {"type": "boolean"}}},
    {"$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["value"],
                        "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 9},
                                       "children": {"type": "array", "maxItems": 2,
                                                    "items": {"$ref": "#/$defs/node"}}}}},
     "$ref": "#/$defs/node"},
    {"definitions": {"item": {"type": "string", "maxLength": 5}},
     "type": "object", "required": ["head"], "additionalProperties": False,
     "properties": {"head": {"$ref": "#/definitions/item"}, "tail": {"type": "array", "maxItems": 3,
                                                                     "items": {"$ref": "#/definitions/item"}}}},
    {"type": "object", "additionalProperties": False, "required": ["event"],
     "properties": {"event": {"oneOf": [
         {"type": "object", "additionalProperties": False, "required": ["kind", "x"],
          "properties": {"kind": {"const": "click"}, "x": {"type": "integer", "minimum": 0, "maximum": 999}}},
         {"type": "object", "additionalProperties": False, "required": ["kind", "key"],
          "properties": {"kind": {"const": "key"}, "key": {"type": "string", "maxLength": 1, "minLength": 1}}}]}}},
    {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "number", "minimum": -1, "maximum": 1}},
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}, "maxProperties": 3},
    {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}]},
    {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
     "properties": {"answer": {"enum": ["yes", "no", "unsure"]}, "confidence": {"type": "number", "minimum": 0,
                                                                                "maximum": 1}}},
    {"type": "object", "additionalProperties": False, "required": ["location", "unit"],  # a tool's parameters
     "properties": {"location": {"type": "string", "maxLength": 24, "description": "City and country"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
    {"type": "object", "additionalProperties": False, "required": ["when", "where"],
     "properties": {"when": {"type": "string", "format": "date-time"}, "where": {"type": ["string", "null"],
                                                                               "maxLength": 16}}},
    {"type": "object", "additionalProperties": False, "required": ["tags"],
     "properties": {"tags": {"type": "array", "maxItems": 4, "items": {"enum": ["a", "b", "c", "d"]}}}},
    {"type": "object", "additionalProperties": False, "required": ["a", "b"],
     "properties": {"a": {"allOf": [{"type": "integer"}, {"minimum": 3}, {"maximum": 7}]}, "b": {"type": "boolean"}}},
    {"$defs": {"list": {"anyOf": [{"type": "null"}, {"type": "object", "additionalProperties": False,
                                                      "required": ["head", "next"],
                                                      "properties": {"head": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9},
                                                                     "next": {"$ref": "#/$defs/list"}}}]}},
     "$ref": "#/$defs/list"},
]

# What llguidance does not implement: a 400 that names it. A oneOf whose options overlap
# cannot be enforced exactly; a schema that accepts anyOf's meaning for it says so with
# "x-guidance": {"coerce_one_of": true}.
REFUSED = [({"type": "array", "uniqueItems": True, "items": {"type": "integer"}}, "uniqueItems"),
           ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf")]


def _compose(rng: random.Random, depth: int) -> dict:
    kind = rng.random()
    if depth == 0 or kind < 0.35:
        return dict(rng.choice(LEAVES))
    if kind < 0.7:
        names = rng.sample(["id", "name", "value", "kind", "count", "note", "ok", "score"], rng.randint(1, 4))
        properties = {name: _compose(rng, depth - 1) for name in names}
        schema = {"type": "object", "properties": properties, "additionalProperties": False}
        schema["required"] = [name for name in names if rng.random() < 0.7]
        return schema
    if kind < 0.88:
        schema = {"type": "array", "items": _compose(rng, depth - 1), "maxItems": rng.randint(1, 4)}
        if rng.random() < 0.5:
            schema["minItems"] = 1
        return schema
    # oneOf only where its options cannot overlap (HAND_WRITTEN): llguidance refuses the rest
    return {"anyOf": [_compose(rng, depth - 1) for _ in range(rng.randint(2, 3))]}


def composed(count: int, seed: int = 2026) -> list[dict]:
    """`count` distinct schemas, none of them a bare leaf."""
    rng, schemas, seen = random.Random(seed), [], {json.dumps(leaf) for leaf in LEAVES}
    while len(schemas) < count:
        schema = _compose(rng, rng.randint(1, 3))
        if json.dumps(schema) not in seen:
            seen.add(json.dumps(schema))
            schemas.append(schema)
    return schemas


def suite() -> list[dict]:
    """The hand-written schemas, then composed ones: 210 in all, no two alike."""
    return HAND_WRITTEN + composed(210 - len(HAND_WRITTEN))
