"""Which result line answers which input line, so each line of a batch file is answered
exactly once across an interrupted run and its `--resume`.

A line that is a request of its own is known by its id: a native line's `id` (its line
number when it has none), an OpenAI line's `custom_id`. Any other line is known by its
line number: one that is not JSON or not an object, an OpenAI line without a string
`custom_id`, and one that repeats an earlier line's id (refused, so that an id names one
result). Such a line's result is an error carrying `line`, and that is what the result
line is known by in turn.
"""

import json

from cbatch.errors import INVALID_REQUEST, CbatchError

LINE_FIELD = "line"  # in the error of a line known by its line number


def id_key(line_id) -> str:
    """The key of a line known by its id (ids may be any JSON value)."""
    return "id " + json.dumps(line_id, sort_keys=True)


def line_key(number: int) -> str:
    return f"line {number}"


def line_error(err: CbatchError, number: int) -> dict:
    """The error of a line known by its line number, which says the number."""
    return {**err.to_dict(), LINE_FIELD: number}


def result_key(result: dict) -> str:
    """The key of the input line a result line answers: a native one's `id`, an OpenAI one's
    `custom_id`, or its error's `line`."""
    error = result.get("error")
    number = error.get(LINE_FIELD) if isinstance(error, dict) else None
    if isinstance(number, int) and not isinstance(number, bool):
        return line_key(number)
    return id_key(result.get("custom_id", result.get("id")))


def native_id(number: int, item: dict):
    return item["id"]  # read_items gave a line without one its line number


def openai_id(number: int, item: dict) -> str:
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str):
        raise CbatchError(INVALID_REQUEST, f"line {number} needs a string custom_id")
    return custom_id


class LineSelector:
    """Picks the lines a run sends: a line whose id an earlier line of the input holds
    becomes its refusal (kept: it is answered), and a line the output already answers is
    skipped and counted. `id_of(number, item)` is the file kind's id of a line that is an
    object (native_id, openai_id), raising CbatchError for one without a usable id.
    Every id of the input is remembered, so that a repeat is known however far apart."""

    def __init__(self, done_keys: set[str], id_of):
        self._done_keys = done_keys
        self._id_of = id_of
        self._first_line_of: dict[str, int] = {}  # id key -> the number of the line that holds it first
        self.num_skipped = 0

    def select(self, numbered_items):
        """(line number, dict or CbatchError) for each line to run; a CbatchError's line is
        known by its number."""
        for number, item in numbered_items:
            key = line_key(number)
            if isinstance(item, dict):
                item, key = self._keyed(number, item)
            if key in self._done_keys:
                self.num_skipped += 1
                continue
            yield number, item

    def _keyed(self, number: int, item: dict) -> tuple[dict | CbatchError, str]:
        try:
            line_id = self._id_of(number, item)
        except CbatchError as err:
            return err, line_key(number)
        key = id_key(line_id)
        first_number = self._first_line_of.setdefault(key, number)
        if first_number != number:
            return CbatchError(INVALID_REQUEST, f"line {number} repeats the id {json.dumps(line_id)} of line "
                                                f"{first_number}: each line needs an id of its own"), line_key(number)
        return item, key
