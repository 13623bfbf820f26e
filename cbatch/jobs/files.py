"""Files as OpenAI's Files API keeps them: an upload's bytes (`files/<id>.jsonl`) and its
object (`files/<id>.json`), written in that order, so a file whose object exists has all
its bytes. A batch's input file is checked as it is copied in: UTF-8, at most
MAX_FILE_BYTES and MAX_FILE_LINES requests (OpenAI's limits for a batch)."""

import codecs
import os
import time
import uuid

from cbatch.api_keys import DEFAULT_TENANT
from cbatch.errors import INVALID_REQUEST, NOT_FOUND, CbatchError
from cbatch.jobs.state_dir import STATE_DIR_MODE, read_json, remove_if_present, replace_from, write_json

MAX_FILE_BYTES = 200 * 1024 * 1024
MAX_FILE_LINES = 50_000
BATCH = "batch"  # the purpose of a batch's input file
BATCH_OUTPUT = "batch_output"  # of its output and error files
PURPOSES = (BATCH,)  # what an upload may be for
COPY_CHUNK_BYTES = 1 << 20


MAX_ID_CHARS = 64  # longer than any id the stores make (file-<24 hex>, batch_<32 hex>): such an id is unknown


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


OWNER = "tenant"  # the stored object's field naming the tenant it belongs to; callers never see it


def file_object(file_id: str, num_bytes: int, filename: str, purpose: str) -> dict:
    return {"id": file_id, "object": "file", "bytes": num_bytes, "created_at": int(time.time()), "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}


def is_visible(obj: dict, viewer: str | None) -> bool:
    """Whether a caller of tenant `viewer` may see a stored file or batch: every caller
    when the daemon checks no keys (viewer None), else only the tenant that made it (one
    made without keys belongs to the default tenant), as OpenAI scopes them to a project."""
    return viewer is None or (obj.get(OWNER) or DEFAULT_TENANT) == viewer


def public(obj: dict) -> dict:
    """A stored object as callers see it: OpenAI's fields (and cbatch's own), not its owner."""
    return {name: value for name, value in obj.items() if name != OWNER}


def _too_large(what: str) -> CbatchError:
    return CbatchError(INVALID_REQUEST, f"the file has more than {what}, the most a batch's input file may hold; "
                                        "split it into several batches")


class _CheckedCopy:
    """Copies an upload, counting its requests (non-blank lines) and checking it is UTF-8
    within the limits as it goes: memory stays one chunk whatever the upload's size."""

    def __init__(self, source):
        self.source = source
        self.num_bytes = self.num_lines = 0

    def __call__(self, out) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")()
        is_line_blank = True
        while chunk := self.source.read(COPY_CHUNK_BYTES):
            self.num_bytes += len(chunk)
            if self.num_bytes > MAX_FILE_BYTES:
                raise _too_large(f"{MAX_FILE_BYTES // (1024 * 1024)} MB")
            try:
                text = decoder.decode(chunk)
            except UnicodeDecodeError:
                raise CbatchError(INVALID_REQUEST, "the file is not UTF-8 text") from None
            *ended_lines, rest = text.split("\n")
            for line in ended_lines:
                self.num_lines += not (is_line_blank and not line.strip())
                is_line_blank = True
            is_line_blank = is_line_blank and not rest.strip()
            if self.num_lines > MAX_FILE_LINES:
                raise _too_large(f"{MAX_FILE_LINES} requests")
            out.write(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise CbatchError(INVALID_REQUEST, "the file is not UTF-8 text: it ends inside a character") from None
        self.num_lines += not is_line_blank
        if self.num_lines > MAX_FILE_LINES:
            raise _too_large(f"{MAX_FILE_LINES} requests")


class FileStore:
    def __init__(self, root: str):
        self.dir = os.path.join(root, "files")
        os.makedirs(self.dir, mode=STATE_DIR_MODE, exist_ok=True)

    def content_path(self, file_id: str) -> str:
        return os.path.join(self.dir, f"{file_id}.jsonl")

    def object_path(self, file_id: str) -> str:
        return os.path.join(self.dir, f"{file_id}.json")

    def upload(self, source, filename: str, purpose: str, tenant: str | None = None) -> dict:
        """A new batch input file of `tenant` (None: no keys are checked) from `source` (a
        binary stream), checked as it is copied."""
        if purpose not in PURPOSES:
            raise CbatchError(INVALID_REQUEST, f"purpose {purpose!r} is not served; this server takes {list(PURPOSES)}")
        file_id = new_file_id()
        copy = _CheckedCopy(source)
        replace_from(copy, self.content_path(file_id))
        if copy.num_lines == 0:
            remove_if_present(self.content_path(file_id))
            raise CbatchError(INVALID_REQUEST, "the file holds no requests")
        return self.add(file_id, copy.num_bytes, filename, purpose, tenant)

    def add(self, file_id: str, num_bytes: int, filename: str, purpose: str, tenant: str | None = None) -> dict:
        """The object of a file whose bytes are in place: from now on the file exists."""
        obj = file_object(file_id, num_bytes, filename, purpose)
        write_json(self.object_path(file_id), {**obj, OWNER: tenant})
        return obj

    def get(self, file_id: str, viewer: str | None = None) -> dict:
        """The file as `viewer` sees it; another tenant's file is as unknown as a missing one."""
        obj = read_json(self.object_path(file_id)) if _is_file_id(file_id) else None
        if obj is None or not is_visible(obj, viewer):
            raise CbatchError(NOT_FOUND, f"no file with id {file_id!r}")
        return public(obj)

    def list(self, purpose: str | None = None, viewer: str | None = None) -> list[dict]:
        """Newest first."""
        objects = [read_json(os.path.join(self.dir, name)) for name in os.listdir(self.dir) if name.endswith(".json")]
        return sorted((public(obj) for obj in objects if obj is not None and purpose in (None, obj["purpose"])
                       and is_visible(obj, viewer)), key=lambda obj: (obj["created_at"], obj["id"]), reverse=True)

    def delete(self, file_id: str, viewer: str | None = None) -> dict:
        self.get(file_id, viewer)
        remove_if_present(self.object_path(file_id))  # first: a file without its object does not exist
        remove_if_present(self.content_path(file_id))
        return {"id": file_id, "object": "file", "deleted": True}


def _is_file_id(file_id: str) -> bool:
    """An id this store could have made: never a path that leads elsewhere, nor a name too
    long for the file system."""
    return file_id.startswith("file-") and file_id[5:].isalnum() and len(file_id) <= MAX_ID_CHARS
