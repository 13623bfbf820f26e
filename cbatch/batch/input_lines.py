"""A batch file's lines read into requests: each line a request dict, or the error that is
that line's result (not JSON, nested too deep, not an object, an id no result could be
written with). cbatch-submit and the job runner read files alike."""

import json

from cbatch.errors import INVALID_REQUEST, CbatchError

ID_KEYS = ("id", "custom_id")  # a line's ids, written back in its result


def is_utf8(value) -> bool:
    """False for a string with a lone surrogate (no UTF-8 for it); True for any other value."""
    if not isinstance(value, str):
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_items(lines):
    """Yield (line number, request dict or CbatchError) per non-blank line."""
    with lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                yield number, CbatchError(INVALID_REQUEST,
                                          f"line {number} is not valid JSON: {err.msg} (column {err.colno})")
                continue
            except RecursionError:  # Python's parser recurses per level: a line 1000 deep is its error alone
                yield number, CbatchError(INVALID_REQUEST, f"line {number} nests arrays or objects too deep")
                continue
            if not isinstance(item, dict):
                yield number, CbatchError(INVALID_REQUEST, f"line {number} must be a JSON object")
                continue
            if not all(isinstance(key, str) for key in item):
                yield number, CbatchError(INVALID_REQUEST, f"line {number} has non-string keys")
                continue
            if not all(is_utf8(item.get(key, "")) for key in ID_KEYS):
                # JSON's "\ud800" escape: an id no result could be written with
                yield number, CbatchError(INVALID_REQUEST, f"line {number} has an id that is not valid UTF-8 "
                                                           f"(a lone surrogate)")
                continue
            item.setdefault("id", number)
            yield number, item
