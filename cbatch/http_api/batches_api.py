"""OpenAI's Files and Batches APIs: /v1/files and /v1/batches, as the `openai` package calls them.

These endpoints only read and write the daemon's state directory (cbatch.jobs); the jobs
run in the daemon's job runner, one place however many HTTP processes serve, and survive
a restart of the daemon. File system work runs in a worker thread, beside the event loop.
With API keys each key's tenant sees only its own files and batches (OpenAI scopes them
to a project): another tenant's id is answered 404, as an unknown one.
"""

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from cbatch.errors import INVALID_REQUEST, CbatchError
from cbatch.http_api.auth import TENANT_SCOPE_KEY
from cbatch.http_api.json_io import json_body, json_response
from cbatch.http_api.state import HttpState
from cbatch.jobs.batches import BatchStore
from cbatch.jobs.files import MAX_FILE_BYTES

ENDPOINT = "batches"  # the metrics' endpoint label
MAX_FORM_OVERHEAD_BYTES = 1 << 20  # a multipart form's headers and boundaries, beside the file
DEFAULT_LIST_LIMIT = {"files": 10_000, "batches": 20}


def _tenant(request: Request) -> str | None:
    """The caller's tenant, the key's; None when the daemon checks no keys."""
    return request.scope.get(TENANT_SCOPE_KEY)


def _page(objects: list[dict], request: Request, kind: str) -> dict:
    """OpenAI's cursor page: up to `limit` objects after the one with id `after`."""
    try:
        limit = int(request.query_params.get("limit", DEFAULT_LIST_LIMIT[kind]))
    except ValueError:
        raise CbatchError(INVALID_REQUEST, "limit must be an integer") from None
    if limit < 1:
        raise CbatchError(INVALID_REQUEST, "limit must be at least 1")
    after = request.query_params.get("after")
    if after is not None:
        ids = [obj["id"] for obj in objects]
        objects = objects[ids.index(after) + 1:] if after in ids else []
    page = objects[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(objects) > limit}


def _too_large() -> CbatchError:
    return CbatchError(INVALID_REQUEST, f"the file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MB, "
                                        "the most a batch's input file may be; split it into several batches")


def _bounded(request: Request) -> Request:
    """The request, its body refused as soon as it passes the upload's limit: a body sent
    without its length (chunked) is not spooled whole first."""
    num_bytes = 0

    async def receive():
        nonlocal num_bytes
        message = await request.receive()
        num_bytes += len(message.get("body", b""))
        if num_bytes > MAX_FILE_BYTES + MAX_FORM_OVERHEAD_BYTES:
            raise _too_large()
        return message

    return Request(request.scope, receive)


async def _upload(store: BatchStore, request: Request) -> Response:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_FILE_BYTES + MAX_FORM_OVERHEAD_BYTES:
        raise _too_large()
    try:
        form = await _bounded(request).form(max_files=1, max_fields=16)
    except CbatchError:
        raise
    except Exception as err:  # Starlette's own refusals of a malformed form (its exception types vary by version)
        raise CbatchError(INVALID_REQUEST,
                          f"the body must be a multipart form with `file` and `purpose`: {err}") from None
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str) or not isinstance(purpose, str):
            raise CbatchError(INVALID_REQUEST, "the form needs a `file` and a `purpose`")
        return json_response(await run_in_threadpool(store.files.upload, upload.file, upload.filename or "upload.jsonl",
                                                     purpose, _tenant(request)))
    finally:
        await form.close()  # the upload's spooled copy


async def _files(store: BatchStore, request: Request) -> Response:
    if request.method == "POST":
        return await _upload(store, request)
    objects = await run_in_threadpool(store.files.list, request.query_params.get("purpose"), _tenant(request))
    return json_response(_page(objects, request, "files"))


async def _file(store: BatchStore, request: Request) -> Response:
    file_id = request.path_params["file_id"]
    if request.method == "DELETE":
        return json_response(await run_in_threadpool(store.files.delete, file_id, _tenant(request)))
    return json_response(await run_in_threadpool(store.files.get, file_id, _tenant(request)))


async def _file_content(store: BatchStore, request: Request) -> Response:
    file_id = request.path_params["file_id"]
    await run_in_threadpool(store.files.get, file_id, _tenant(request))  # a file without its object does not exist
    return FileResponse(store.files.content_path(file_id), media_type="application/jsonl")


async def _batches(store: BatchStore, request: Request) -> Response:
    if request.method == "POST":
        body = json_body(await request.body())
        return json_response(await run_in_threadpool(store.create, body, _tenant(request)))
    return json_response(_page(await run_in_threadpool(store.list, _tenant(request)), request, "batches"))


async def _batch(store: BatchStore, request: Request) -> Response:
    return json_response(await run_in_threadpool(store.get, request.path_params["batch_id"], _tenant(request)))


async def _cancel(store: BatchStore, request: Request) -> Response:
    return json_response(await run_in_threadpool(store.cancel, request.path_params["batch_id"], _tenant(request)))


def batch_routes(state: HttpState, store: BatchStore) -> list[Route]:
    def bind(handler):
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(store, request)
            except CbatchError as err:
                return state.error(ENDPOINT, err)
        return endpoint

    return [
        Route("/v1/files", bind(_files), methods=["GET", "POST"]),
        Route("/v1/files/{file_id}", bind(_file), methods=["GET", "DELETE"]),
        Route("/v1/files/{file_id}/content", bind(_file_content), methods=["GET"]),
        Route("/v1/batches", bind(_batches), methods=["GET", "POST"]),
        Route("/v1/batches/{batch_id}", bind(_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", bind(_cancel), methods=["POST"]),
    ]
