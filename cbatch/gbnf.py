"""Checks on GBNF text that llama.cpp's grammar parser would pay for (or crash on) in the
decode worker, made before a request is accepted: how deep it nests groups (the parser
recurses per group) and how many repetitions its `{m,n}` bounds make (a rule each)."""

import re

MAX_GRAMMAR_NESTING = 64  # llama.cpp's GBNF parser recurses per group: deeper input overflows its stack
MAX_REPETITION_BOUND = 2000  # llama.cpp's limit on one {m,n}: a larger minimum fails, a larger maximum is dropped
# All {m,n} bounds of one request's grammar: llama.cpp makes a rule per repetition (about
# 1 us and 230 bytes each in the decode worker, which parses the grammar on its loop).
MAX_GRAMMAR_REPETITIONS = 8192
_REPETITION = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _outside_literals(text: str):
    """(position, character) of the GBNF text's characters outside "..." and [...], where
    brackets and braces are literal characters."""
    quote = None
    escaped = False
    for position, char in enumerate(text):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif quote:
            if char == quote:
                quote = None
        elif char in "\"[":
            quote = "\"" if char == "\"" else "]"
        else:
            yield position, char


def grammar_nesting(text: str) -> int:
    """How deep the GBNF text nests parenthesized groups."""
    depth = max_depth = 0
    for _, char in _outside_literals(text):
        if char == "(":
            depth += 1
            max_depth = max(max_depth, depth)
        elif char == ")":
            depth -= 1
    return max_depth


def grammar_repetitions(text: str) -> tuple[int, int]:
    """(the largest bound of one {m,n} repetition, all bounds together) in the GBNF text."""
    largest = total = 0
    for position, char in _outside_literals(text):
        match = _REPETITION.match(text, position) if char == "{" else None
        if match:
            bound = max(int(match.group(1)), int(match.group(2) or 0))
            largest, total = max(largest, bound), total + bound
    return largest, total


def grammar_problem(text: str) -> str | None:
    """What is wrong with the text's nesting or repetitions (to follow "grammar "), or None."""
    max_depth = grammar_nesting(text)
    if max_depth > MAX_GRAMMAR_NESTING:
        return f"nests groups {max_depth} deep; at most {MAX_GRAMMAR_NESTING}"
    largest, total = grammar_repetitions(text)
    if largest > MAX_REPETITION_BOUND or total > MAX_GRAMMAR_REPETITIONS:
        return (f"repeats with {{m,n}} bounds up to {largest}, {total} in all; at most {MAX_REPETITION_BOUND} each "
                f"and {MAX_GRAMMAR_REPETITIONS} in all (llama.cpp makes a rule per repetition, in the decode loop)")
    return None
