"""`cbatch-submit --resume`: which lines of the input an earlier run already wrote."""

import json
import os


def id_key(item) -> str:
    """The JSON text of a line's id (ids may be any JSON value)."""
    return json.dumps(item.get("custom_id", item.get("id")), sort_keys=True)


def prepare_resume(output_path: str) -> set[str]:
    """Ids of the lines an earlier run already wrote to `output_path`. A last line cut by
    an interruption is removed, so appending continues the file cleanly."""
    if not os.path.exists(output_path):
        return set()
    with open(output_path, "rb+") as out:
        data = out.read()
        complete = data[:data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            out.truncate(len(complete))
    ids = set()
    for line in complete.decode("utf-8", errors="replace").splitlines():
        try:
            ids.add(id_key(json.loads(line)))
        except (json.JSONDecodeError, AttributeError):
            continue  # not a result line: it will not match any input
    return ids
