"""JSON schemas (a tool's parameters, a response_format) made into GBNF, with bounded work
and a bounded grammar, for the HTTP server, batch files and native clients alike.

llama-cpp-python's converter writes a length bound out one optional item at a time, one
group nested in the next, so its work and its grammar grow with the bound: `maxLength:
100000000` took seconds and hundreds of MB before the daemon refused the grammar. Here:
- a string's or an array's bounds are GBNF repetitions (`char{0,500}`), which llama.cpp
  turns into a rule per optional item when the decode worker starts the request: one
  bound is at most MAX_REPETITION_BOUND (past llama.cpp's own limit it drops a maximum), and
  all a request's bounds and pattern quantifiers together at most MAX_GRAMMAR_REPETITIONS,
  checked before anything is converted;
- the converter writes a pattern's quantifiers out; they count against the same total;
- the conversion stops as soon as the grammar passes the daemon's limits on size and
  nesting (cbatch/params.py).
Each refusal is an invalid_request naming the schema field to change. The converter
ignores integer bounds: an integer with integer bounds, of any width or on one side only,
is written here digit by digit (cbatch/tools/integer_ranges.py).
"""

import functools
import math
import re

from cbatch.errors import CbatchError
from cbatch.extras import SERVER, check_extra
from cbatch.gbnf import MAX_GRAMMAR_NESTING, MAX_GRAMMAR_REPETITIONS, MAX_REPETITION_BOUND, grammar_nesting
from cbatch.params import MAX_GRAMMAR_CHARS, invalid
from cbatch.tools.integer_ranges import MAX_DIGITS, integer_range

BOUNDS = {"string": ("minLength", "maxLength"), "array": ("minItems", "maxItems")}
DATA_KEYS = ("enum", "const", "default", "examples")  # values, not schemas: taken as they are
# Keys that send a string or array schema down another of the converter's ways.
_NOT_PLAIN = ("$ref", "oneOf", "anyOf", "allOf", "const", "enum", "pattern", "format", "prefixItems")
ITEM_SEPARATOR = '"," space'  # between a JSON array's items, as the converter writes it
# A JSON string's character: the converter's own rule lets raw control characters (a
# newline) in, which no JSON parser takes.
JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _integer_bounds(schema: dict) -> tuple[int | None, int | None] | None:
    """(lowest, highest) integer a schema allows when it is an integer with numeric bounds
    (None on a side without one); None for any other schema. A bound that is not whole
    rounds inward (`minimum: 1.5` allows 2 on); draft 4's boolean `exclusiveMinimum` and
    `exclusiveMaximum` make `minimum` and `maximum` exclusive. Both ends are held to the
    integers of at most MAX_DIGITS digits, as the grammar writes any integer."""
    if schema.get("type") != "integer" or any(key in schema for key in _NOT_PLAIN):
        return None
    lows, highs = [], []
    minimum, maximum = schema.get("minimum"), schema.get("maximum")
    is_min_exclusive, is_max_exclusive = schema.get("exclusiveMinimum") is True, schema.get("exclusiveMaximum") is True
    if _is_number(minimum):
        lows.append(math.floor(minimum) + 1 if is_min_exclusive else math.ceil(minimum))
    if _is_number(schema.get("exclusiveMinimum")):
        lows.append(math.floor(schema["exclusiveMinimum"]) + 1)
    if _is_number(maximum):
        highs.append(math.ceil(maximum) - 1 if is_max_exclusive else math.floor(maximum))
    if _is_number(schema.get("exclusiveMaximum")):
        highs.append(math.ceil(schema["exclusiveMaximum"]) - 1)
    if not lows and not highs:
        return None
    largest = 10 ** MAX_DIGITS - 1
    low = min(max(max(lows), -largest), largest + 1) if lows else None
    high = max(min(min(highs), largest), -largest - 1) if highs else None
    return low, high


def _count(field: str, value) -> int:
    """A repetition bound: a non-negative integer (1e3 is one too) up to MAX_REPETITION_BOUND."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or value != int(value):
        raise invalid(f"{field} must be a non-negative integer, got {value!r}")
    if value > MAX_REPETITION_BOUND:
        raise invalid(f"{field} is {value}; at most {MAX_REPETITION_BOUND}: the grammar that enforces it grows "
                      "with it. Lower it or leave it out")
    return int(value)


class SchemaFields:
    """A request's JSON schemas, checked and bounded, each node with the request field it
    came from (for the refusals of the conversion, which sees only the nodes)."""

    def __init__(self):
        self._field_of: dict[int, str] = {}  # id(schema node) -> its field in the request
        self._nodes: list[dict] = []  # kept alive: an id names its node only while it lives
        self._num_repetitions = 0

    def checked(self, schema, field: str):
        """A copy of `schema` whose bounds passed."""
        if isinstance(schema, list):
            return [self.checked(item, f"{field}[{i}]") for i, item in enumerate(schema)]
        if not isinstance(schema, dict):
            return schema
        node = {key: value if key in DATA_KEYS else self.checked(value, f"{field}.{key}")
                for key, value in schema.items()}
        self._count_bounds(node, field)
        low, high = _integer_bounds(node) or (None, None)
        largest = 10 ** MAX_DIGITS - 1
        if (low if low is not None else -largest) > (high if high is not None else largest):
            raise invalid(f"{field}'s bounds leave no integer of at most {MAX_DIGITS} digits to match")
        self._field_of[id(node)] = field
        self._nodes.append(node)
        return node

    def _count_bounds(self, node: dict, field: str) -> None:
        for low, high in BOUNDS.values():  # a bound that is a schema is a property of that name
            counts = {key: _count(f"{field}.{key}", node[key]) for key in (low, high)
                      if key in node and not isinstance(node[key], dict)}
            if low in counts and high in counts and counts[low] > counts[high]:
                raise invalid(f"{field}.{low} is more than its {high}: no value can match")
            node.update(counts)  # 1e3 as 1000: the grammar writes it
            if counts:
                self._add_repetitions(f"{field}.{high if high in counts else low}", counts.get(high, counts.get(low)))
        if isinstance(node.get("pattern"), str):
            for match in _QUANTIFIER.finditer(node["pattern"]):
                low, high = (_count(f"{field}.pattern's {match.group(0)}", int(number)) if number else None
                             for number in match.groups())
                self._add_repetitions(f"{field}.pattern", high if high is not None else low or 0)

    def _add_repetitions(self, field: str, count: int) -> None:
        self._num_repetitions += count
        if self._num_repetitions > MAX_GRAMMAR_REPETITIONS:
            raise invalid(f"{field} takes the repetitions the schemas' grammar allows to {self._num_repetitions}; at "
                          f"most {MAX_GRAMMAR_REPETITIONS} in all (maxLength, minLength, maxItems, minItems and "
                          "pattern quantifiers): lower it or the others")

    def grammar(self, schema: dict, field: str, root_name: str = "", head: str = "") -> str:
        """GBNF for a schema built of checked() nodes (`field` names the whole of it),
        after the rules in `head`."""
        converter = _converter_class()(self._field_of, field, len(head))
        try:
            converter.visit(converter.resolve_refs(schema, "schema"), root_name)
            return head + converter.format_grammar()
        except CbatchError:
            raise
        except Exception as err:  # the converter raises plain exceptions (and asserts) for what it cannot take
            raise invalid(f"{field} cannot be converted to a grammar: {err!r}") from None


def _line_chars(name: str, rule: str) -> int:
    return len(name) + len(" ::= ") + len(rule) + len("\n")


def _repeated(item: str, low: int, high: int | None) -> str:
    return f"{item}{{{low},{'' if high is None else high}}}"


@functools.cache
def _converter_class():
    """Made on first use: llama_cpp loads the llama.cpp library, which clients that never
    convert a schema should not load."""
    check_extra(SERVER, ("llama_cpp",), "a JSON schema's grammar (a forced tool call, a json_schema response format)")
    from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, BuiltinRule, SchemaConverter

    def _rule_name(name: str) -> str:
        return name + "-" if name in RESERVED_NAMES else name or "root"  # as the converter names it

    class BoundedConverter(SchemaConverter):
        """llama-cpp-python's converter, writing string and array bounds as repetitions,
        strings without raw control characters, and stopping as soon as the grammar passes
        the daemon's limits."""

        def __init__(self, field_of: dict[int, str], field: str, num_head_chars: int):
            super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
            self._field_of = field_of
            self._fields = [field]  # of the nodes being visited, innermost last
            # At least the grammar's length (format_grammar writes "name ::= rule" lines):
            # the conversion stops as soon as it passes the limit.
            self._num_chars = num_head_chars + sum(_line_chars(name, rule) for name, rule in self._rules.items())

        def visit(self, schema, name):
            field = self._field_of.get(id(schema))
            if field is not None:
                self._fields.append(field)
            try:
                return self._visit_integer(schema, name) or self._visit_plain(schema, name) \
                    or super().visit(schema, name)
            finally:
                if field is not None:
                    self._fields.pop()

        def _visit_integer(self, schema: dict, name: str) -> str | None:
            """An integer with bounds; None for any other schema."""
            bounds = _integer_bounds(schema)
            if bounds is None:
                return None
            return self._add_rule(_rule_name(name), f"({integer_range(*bounds)}) space")

        def _visit_plain(self, schema: dict, name: str) -> str | None:
            """A string with a length bound, an array of one item schema with an item count
            bound; None for any other schema."""
            kind = schema.get("type")
            low_key, high_key = BOUNDS.get(kind, (None, None)) if isinstance(kind, str) else (None, None)
            if low_key is None or not (low_key in schema or high_key in schema) or any(k in schema for k in _NOT_PLAIN):
                return None
            low, high = schema.get(low_key, 0), schema.get(high_key)
            if not isinstance(low, int) or not isinstance(high, (int, type(None))):  # a property named so
                return None
            rule_name = _rule_name(name)
            if kind == "string":
                char = self._add_primitive("char", PRIMITIVE_RULES["char"])
                return self._add_rule(rule_name, rf'"\"" {_repeated(char, low, high)} "\"" space')
            if not isinstance(schema.get("items"), dict):
                return None
            if high == 0:
                return self._add_rule(rule_name, '"[" space "]" space')
            item = self.visit(schema["items"], f"{name}{'-' if name else ''}item")
            # Rules, not groups, are repeated and made optional: llama.cpp counts the rules
            # made inside a group (a repetition's among them) against its repetition limit.
            more = self._add_rule(f"{rule_name}-more", f"{ITEM_SEPARATOR} {item}")
            rest = _repeated(more, max(low - 1, 0), None if high is None else high - 1)
            items = self._add_rule(f"{rule_name}-items", f"{item} {rest}")
            return self._add_rule(rule_name, f'"[" space {items}{"" if low else "?"} "]" space')

        def _add_primitive(self, name: str, rule):
            return super()._add_primitive(name, BuiltinRule(JSON_CHAR, []) if name == "char" else rule)

        def _add_rule(self, name, rule):
            num_rules = len(self._rules)
            key = super()._add_rule(name, rule)
            if len(self._rules) > num_rules:  # a new rule, not one made again
                self._num_chars += _line_chars(key, rule)
            field = self._fields[-1]
            if self._num_chars > MAX_GRAMMAR_CHARS:
                where = "" if field == self._fields[0] else f", passing the limit at {field}"
                raise invalid(f"{self._fields[0]} makes a grammar of more than {MAX_GRAMMAR_CHARS} characters{where}: "
                              "lower its bounds or pattern quantifiers, or have fewer properties or enum values")
            depth = grammar_nesting(rule)
            if depth > MAX_GRAMMAR_NESTING:
                raise invalid(f"{field} nests its grammar's groups {depth} deep; at most {MAX_GRAMMAR_NESTING}: "
                              "lower the repetitions in its pattern")
            return key

    return BoundedConverter
