"""A batch over HTTP: the same items and arrivals as Client.stream_batch, sent as
non-streamed requests to any OpenAI-compatible endpoint, so one submitter drives every
daemon behind a router.

The batch policy is BatchFeeder's, unchanged (bounded pull-ahead, a request's choices end
together); this module is the session it drives. The requests run on an asyncio loop in
a thread of their own (httpx's AsyncClient, so an interrupted batch cancels what it sent
at once instead of waiting for answers); each one ends by putting its one chunk, or its
error, in its stream. A transient failure (batch_retry: a full or restarting server's 429,
502, 503 or 504, a connection that fails, a try that outlasts `request_timeout_s`) is
retried after the answer's Retry-After or a backoff, while the batch's patience lasts;
then its error arrives, and a batch file's run stops there (it is not a result).
"""

import asyncio
import base64
import itertools
import threading

import httpx

from cbatch.client.base import Embeddings
from cbatch.client.batch_feeder import DEFAULT_MAX_IN_FLIGHT, BatchFeeder
from cbatch.client.batch_retry import DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_RETRY_FOR_S, MAX_BACKOFF_S, Patience, Tries
from cbatch.client.openai_wire import chunk_from_response, error_from_response, http_request
from cbatch.client.streams import Chunk, RequestStream
from cbatch.errors import INTERNAL, INVALID_REQUEST, UNAVAILABLE, CbatchError

CONNECT_TIMEOUT_S = 10.0
MAX_MODELS_WAIT_S = 30.0  # for the listing GET /models asked first: the endpoint's first answer
# A 500 other than a failed decode (decode_failed: the line's result) is sent again this
# many times, as the openai package does, before it is the line's result: a router answers
# one for a daemon that just exited.
MAX_SERVER_ERROR_RETRIES = 2
WAKE_S = 0.5  # the waiting thread wakes this often, so Ctrl-C is never held up


def _retry_after_s(response: httpx.Response) -> float | None:
    """Retry-After in seconds (its date form is not used by OpenAI-style servers)."""
    try:
        return min(max(float(response.headers["retry-after"]), 0.0), MAX_BACKOFF_S)
    except (KeyError, ValueError):
        return None


class _HttpSession:
    """What BatchFeeder asks of a session (submit, cancel, forget, taken, is_closed, failure), over
    HTTP. Streams are completed on the loop's thread under `arrived`, the lock the waiting
    thread holds while it takes arrivals, so a stream is never seen done without its chunk."""

    failure = None  # never set: over HTTP each request fails on its own, after its retries

    def __init__(self, http: httpx.AsyncClient, loop: asyncio.AbstractEventLoop, model: str | None,
                 patience: Patience, request_timeout_s: float):
        self._http, self._loop, self.model = http, loop, model
        self._patience, self._request_timeout_s = patience, request_timeout_s
        self.arrived = threading.Condition()
        self._request_ids = itertools.count(1)
        self._tasks: dict[int, asyncio.Future] = {}
        self.is_closed = False

    def submit(self, body: dict, label=None) -> RequestStream:
        if not isinstance(body, dict):
            raise CbatchError(INVALID_REQUEST, "a request must be a dict")
        stream = RequestStream(next(self._request_ids), label)
        if stream.label is None:
            stream.label = stream.request_id
        self._tasks[stream.request_id] = asyncio.run_coroutine_threadsafe(self._run(stream, body), self._loop)
        return stream

    def cancel(self, request_id: int) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def forget(self, stream: RequestStream) -> None:
        self._tasks.pop(stream.request_id, None)

    def taken(self, stream: RequestStream) -> None:
        """Each answer comes whole, and the server holds nothing back for this caller:
        nothing is paused, so nothing goes on."""

    async def _run(self, stream: RequestStream, body: dict) -> None:
        path, payload = http_request(body, self.model)
        try:
            outcome = chunk_from_response(stream.label, path, await self.post(path, payload))
        except CbatchError as err:
            outcome = err
        with self.arrived:
            if isinstance(outcome, Chunk):
                stream.is_done = True
                stream.pending.append(outcome)
            else:
                stream.fail(outcome)
            self.arrived.notify_all()

    async def post(self, path: str, payload: dict) -> dict:
        """The response body of a request that succeeded; a transient failure is retried
        while the batch's patience lasts, and raised when it is spent."""
        tries, num_server_errors = Tries(), 0
        while True:
            try:
                response = await _within(self._request_timeout_s, self._http.post(path.lstrip("/"), json=payload))
            except CbatchError as failure_of_try:
                failure, wait_s = failure_of_try, None
            else:
                if response.is_success:
                    self._patience.on_progress()
                    return _json(response)
                failure = error_from_response(response.status_code, response.text, _json(response, {}))
                wait_s = _retry_after_s(response)
                is_server_error = response.status_code == 500 and failure.code == INTERNAL
                if is_server_error and num_server_errors < MAX_SERVER_ERROR_RETRIES:
                    num_server_errors += 1
                    failure = CbatchError(UNAVAILABLE, failure.message)  # held as a 503 is
            wait_s = self._patience.hold(tries, failure, wait_s)
            if wait_s is None:
                raise failure
            await asyncio.sleep(wait_s)


async def _within(timeout_s: float, sending) -> httpx.Response:
    """The response of one try, or an `unavailable` error: the connection failed, or no
    whole answer came within timeout_s (httpx bounds each read; this, the whole try)."""
    try:
        return await asyncio.wait_for(sending, timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise CbatchError(UNAVAILABLE, f"no answer within {timeout_s:g} s") from None
    except httpx.TransportError as err:
        raise CbatchError(UNAVAILABLE, f"the connection failed: {err!r}") from None


def _json(response: httpx.Response, default=None):
    try:
        return response.json()
    except ValueError:
        if default is not None:
            return default
        raise CbatchError(UNAVAILABLE, f"the server's answer is not JSON: {response.text[:200]!r}") from None


class HttpBatchClient:
    """Runs batches against `base_url` (e.g. http://router:30000/v1). With no `model`,
    the first one GET /models lists is asked for. `api_key` goes as a Bearer token."""

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 retry_for_s: float = DEFAULT_RETRY_FOR_S, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
        self.base_url = base_url.rstrip("/") + "/"
        self._http: httpx.AsyncClient | None = None
        self._session: _HttpSession | None = None
        self.patience = Patience(retry_for_s)  # the batch's, which embeddings share
        self._request_timeout_s = request_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cbatch-http-batch", daemon=True)
        self._thread.start()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(request_timeout_s, connect=min(CONNECT_TIMEOUT_S, request_timeout_s))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        try:
            self._http = self._call(self._make_http(headers, timeout, limits))
            self._session = _HttpSession(self._http, self._loop, model, self.patience, request_timeout_s)
            # What a batch line's `model` may name, and the thinking tags a cbatch server
            # lists with them (None for other servers: a line's reasoning_budget is refused).
            self.model_names, self.reasoning = self._call(self._served_models())
            if model is None:
                self._session.model = self.model_names[0]
        except BaseException:
            self.close()
            raise

    async def _make_http(self, headers, timeout, limits) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout, limits=limits)

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _served_models(self) -> tuple[list[str], dict | None]:
        wait_s = min(MAX_MODELS_WAIT_S, self._request_timeout_s)
        try:
            response = await _within(wait_s, self._http.get("models", timeout=wait_s))
        except CbatchError as err:
            raise CbatchError(UNAVAILABLE, f"nothing answers at {self.base_url}: GET models: {err.message}") from None
        if not response.is_success:
            raise error_from_response(response.status_code, response.text, _json(response, {}))
        models = _json(response).get("data") or []
        if not models:
            raise CbatchError(UNAVAILABLE, f"{self.base_url}models lists no model")
        reasoning = models[0].get("reasoning")
        if not (isinstance(reasoning, dict) and isinstance(reasoning.get("tags"),
                                                           list) and len(reasoning["tags"]) == 2):
            return [model["id"] for model in models], None
        return [model["id"] for model in models], {"tags": reasoning["tags"],
                                                   "opened_by_prompt": reasoning.get("opened_by_prompt") is True}

    @property
    def model(self) -> str:
        return self._session.model

    def stream_batch(self, items, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT):
        """As Client.stream_batch: (item position, chunk or error) as they arrive; here each
        item gets one chunk, its whole completion, and each request is retried on its own
        within the client's patience."""
        feeder = BatchFeeder(self._session, items, max_in_flight)
        arrived = self._session.arrived
        try:
            while True:
                yield from feeder.fill()
                if feeder.is_done:
                    return
                with arrived:
                    while not feeder.has_arrivals():
                        arrived.wait(WAKE_S)
                    arrivals = feeder.take_arrivals()
                yield from arrivals
        finally:
            feeder.close()

    def embeddings(self, inputs: list, dimensions: int | None = None) -> Embeddings:
        """As Client.embeddings, from the endpoint's /embeddings (retried as a completion is)."""
        payload = {"model": self.model, "input": inputs, "encoding_format": "base64",
                   **({} if dimensions is None else {"dimensions": dimensions})}
        body = self._call(self._session.post("/embeddings", payload))
        try:
            return Embeddings([base64.b64decode(entry["embedding"]) for entry in body["data"]],
                              body.get("usage", {}).get("prompt_tokens", 0))
        except (KeyError, TypeError, ValueError):
            raise CbatchError(UNAVAILABLE, f"{self.base_url}embeddings answered no base64 embeddings") from None

    def close(self) -> None:
        if self._session is not None:
            self._session.is_closed = True
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
