"""GBNF for the JSON integers between two bounds, either of which may be missing: what a
schema's integer `minimum`/`maximum` (and their exclusive forms) allows, which
llama-cpp-python's JSON-schema converter ignores.

A range is written digit by digit, one length of number at a time, as regular expressions
for numeric ranges are: 17 to 342 is `"1" [7-9] | [2-9] [0-9] | "3" ("4" [0-2] | [0-3]
[0-9])` after splitting it at 99. The numbers are JSON's (no leading zero, no `-0`) and
have at most MAX_DIGITS digits, as the converter's own integer rule (`[1-9] [0-9]{0,15}`).
The expression nests one group per digit, so at most MAX_DIGITS deep.
"""

MAX_DIGITS = 16  # of an integer the grammar writes, bounded or not


def _digits(low: str, high: str) -> str:
    """One digit from `low` to `high`."""
    return f"[{low}]" if low == high else f"[{low}-{high}]"


def _any_digits(count: int) -> str:
    return "" if not count else " [0-9]" if count == 1 else f" [0-9]{{{count}}}"


def _same_length(low: str, high: str) -> str:
    """The numbers from `low` to `high` (digit strings of one length, low <= high)."""
    rest = len(low) - 1
    if not rest:
        return _digits(low, high)
    if low[0] == high[0]:
        return f'"{low[0]}" ({_same_length(low[1:], high[1:])})'
    is_low_whole, is_high_whole = low[1:] == "0" * rest, high[1:] == "9" * rest  # their first digit's every number
    parts = [] if is_low_whole else [f'"{low[0]}" ({_same_length(low[1:], "9" * rest)})']
    first, last = chr(ord(low[0]) + (not is_low_whole)), chr(ord(high[0]) - (not is_high_whole))
    if first <= last:
        parts.append(_digits(first, last) + _any_digits(rest))
    if not is_high_whole:
        parts.append(f'"{high[0]}" ({_same_length("0" * rest, high[1:])})')
    return " | ".join(parts)


def _naturals(low: int, high: int | None) -> list[str]:
    """Alternatives for the numbers from `low` (>= 0) to `high` (None: as long as MAX_DIGITS allows)."""
    num_low_digits = len(str(low))
    if high is None:
        parts = [_same_length(str(low), "9" * num_low_digits)]
        if num_low_digits < MAX_DIGITS:  # every longer number
            parts.append(f"[1-9] [0-9]{{{num_low_digits},{MAX_DIGITS - 1}}}")
        return parts
    parts = []
    for num_digits in range(num_low_digits, len(str(high)) + 1):
        first = max(low, 10 ** (num_digits - 1) if num_digits > 1 else 0)
        parts.append(_same_length(str(first), str(min(high, 10 ** num_digits - 1))))
    return parts


def integer_range(low: int | None, high: int | None) -> str:
    """A GBNF expression for the integers in [low, high] (None: unbounded on that side);
    low <= high where both are given, and neither longer than MAX_DIGITS digits (the
    schema's bounds are held to that before they come here)."""
    alternatives = []
    if low is None or low < 0:  # negative numbers: "-" and their magnitudes
        magnitudes = _naturals(1 if high is None or high >= 0 else -high, None if low is None else -low)
        alternatives.append(f'"-" ({" | ".join(magnitudes)})')
    if high is None or high >= 0:
        alternatives += _naturals(0 if low is None or low < 0 else low, high)
    return " | ".join(alternatives)
