"""`cbatch-submit --resume`: which lines of the input an earlier run already wrote.

The output must end with each input line answered once (line_keys: by its id, or its
line number). A line whose result is a transient error (a
draining, restarting or full daemon's, which an older cbatch-submit wrote as a result) is
not done: it is removed from the output, which is rewritten without it, and runs again.
"""

import json
import os
import shutil

from cbatch.batch.line_keys import result_key
from cbatch.client.batch_retry import TRANSIENT_CODES


def is_transient_result(result: dict) -> bool:
    """A native line's `error`, an OpenAI line's `error` or its failed response's error body,
    with a transient code."""
    response = result.get("response")
    body = response.get("body") if isinstance(response, dict) else None
    errors = (result.get("error"), body.get("error") if isinstance(body, dict) else None)
    return any(isinstance(error, dict) and error.get("code") in TRANSIENT_CODES for error in errors)


def prepare_resume(output_path: str) -> tuple[set[str], int]:
    """(the keys of the input lines an earlier run already answered in `output_path`, the
    number of lines it then holds). A last line cut by an interruption is removed, and so
    are transient errors' lines, so appending continues the file cleanly and their input
    lines run again."""
    if not os.path.exists(output_path):
        return set(), 0
    with open(output_path, "rb") as out:
        data = out.read()
    complete = data[:data.rfind(b"\n") + 1]
    keys, kept_lines = set(), []
    lines = [line + b"\n" for line in complete.split(b"\n")[:-1]]
    for line in lines:
        try:
            result = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            result = None  # not a result line: it will not match any input
        if isinstance(result, dict):
            if is_transient_result(result):
                continue
            keys.add(result_key(result))
        kept_lines.append(line)
    if len(kept_lines) != len(lines):
        _replace(output_path, b"".join(kept_lines))
    elif len(complete) != len(data):
        with open(output_path, "rb+") as out:
            out.truncate(len(complete))
    return keys, len(kept_lines)


def _replace(output_path: str, data: bytes) -> None:
    """Rewrite the file whole: a run stopped meanwhile leaves the old one or the new one."""
    temporary_path = f"{output_path}.resume-tmp"
    with open(temporary_path, "wb") as out:
        out.write(data)
    shutil.copymode(output_path, temporary_path)
    os.replace(temporary_path, output_path)
