"""`cbatch-submit --detach` and `--wait`: an OpenAI batch file handed to a daemon as a batch
job (its Files and Batches APIs, over `--url`), which runs it whether or not the caller
stays; and, later, the job's results once it ended.

--detach uploads the file and creates the job for the endpoint its first request names
(a job runs one endpoint; a line for another is an error line), then prints the job's id.
--wait polls the job until it ends and writes its output file's lines, then its error
file's (each in input order), as cbatch-submit writes a run's.
"""

import json
import sys
import time

import httpx

from cbatch.errors import EXIT_FAILED, EXIT_OK, INVALID_REQUEST, UNAVAILABLE, CbatchError

POLL_S = 1.0  # between looks at a job that has not ended
TIMEOUT_S = 600.0  # one HTTP request: an upload of up to 200 MB included
FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")


def _checked(response: httpx.Response) -> httpx.Response:
    if response.is_success:
        return response
    try:
        error = response.json()["error"]
        message, code = error["message"], error.get("code") or INVALID_REQUEST
    except (ValueError, KeyError, TypeError):
        message, code = f"HTTP {response.status_code}", UNAVAILABLE if response.status_code >= 500 else INVALID_REQUEST
    raise CbatchError(code, message)


def _first_url(path: str) -> str:
    """The endpoint of the file's first request."""
    with open(path, encoding="utf-8-sig") as lines:
        for line in lines:
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(item, dict) and isinstance(item.get("url"), str):
                return item["url"]
    raise CbatchError(INVALID_REQUEST, f"{path} has no OpenAI batch line with a url")


class JobsClient:
    """The daemon's /v1/files and /v1/batches, at an OpenAI base URL."""

    def __init__(self, base_url: str, api_key: str | None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=TIMEOUT_S)

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            return _checked(self.http.request(method, path, **kwargs))
        except httpx.TransportError as err:
            raise CbatchError(UNAVAILABLE, f"cannot reach {self.http.base_url}: {err}") from None

    def detach(self, path: str) -> str:
        endpoint = _first_url(path)
        with open(path, "rb") as upload:
            input_file = self._call("POST", "/files", files={"file": (path.rsplit("/", 1)[-1], upload)},
                                    data={"purpose": "batch"}).json()
        batch = self._call("POST", "/batches", json={"input_file_id": input_file["id"], "endpoint": endpoint,
                                                      "completion_window": "24h"}).json()
        return batch["id"]

    def wait(self, batch_id: str, out) -> int:
        """Write the ended job's lines to `out`; EXIT_OK when it completed with none failed."""
        while (batch := self._call("GET", f"/batches/{batch_id}").json())["status"] not in FINAL_STATUSES:
            time.sleep(POLL_S)
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            if file_id is not None:
                out.write(self._call("GET", f"/files/{file_id}/content").text)
        out.flush()
        counts = batch["request_counts"]
        print(f"cbatch-submit: batch {batch_id} {batch['status']}: {counts['completed']} ok, {counts['failed']} failed "
              f"of {counts['total']}", file=sys.stderr)
        return EXIT_OK if batch["status"] == "completed" and not counts["failed"] else EXIT_FAILED

    def close(self) -> None:
        self.http.close()
