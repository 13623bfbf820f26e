"""Which keywords of a request's schema are left unenforced: a schema sent without
`strict` is compiled leniently (cbatch/openai/mapping.py), and the keywords llguidance does
not implement (`uniqueItems`, `contains`, ...) are named to the caller in the
X-Cbatch-Unenforced-Keywords response header. llguidance's own validation, which needs no
vocabulary, says which they are; it runs where the request is parsed, off the event loop."""

import json
import re

import llguidance

HEADER = "X-Cbatch-Unenforced-Keywords"
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")


def unenforced_keywords(schema) -> list[str]:
    """The keywords a lenient schema leaves unenforced; [] for none, or for a schema that is
    not lenient (its unimplemented keywords are refused instead)."""
    options = schema.get("x-guidance") if isinstance(schema, dict) else None
    if not isinstance(options, dict) or options.get("lenient") is not True:
        return []
    try:
        _, notes = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_json_schema(schema))
    except (ValueError, TypeError):  # the worker's compile names what is wrong
        return []
    found = [match for match in map(_UNIMPLEMENTED.search, notes) if match]
    return json.loads(found[0].group(1)) if found else []


def unenforced_header(bodies: list[dict]) -> dict | None:
    """The response header naming the unenforced keywords of the request's schema, if any."""
    keywords = sorted({keyword for body in bodies[:1] for keyword in unenforced_keywords(body.get("json_schema"))})
    return {HEADER: ", ".join(keywords)} if keywords else None
