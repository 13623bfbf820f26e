"""What the HTTP app shares across requests: the daemon client, the model, drain state."""

import asyncio
import logging
import math
import time

from starlette.responses import Response

from cbatch.client.async_client import AsyncClient
from cbatch.errors import SHUTTING_DOWN, UNAVAILABLE, CbatchError
from cbatch.http_api.json_io import json_response
from cbatch.http_api.metrics import HttpMetrics
from cbatch.openai.completions_output import system_fingerprint
from cbatch.openai.mapping import RETRY_AFTER_S, error_body, error_status

log = logging.getLogger("cbatch.http")

CONNECT_RETRY_S = 0.5  # between attempts to reach the daemon at start-up
HEALTH_TIMEOUT_S = 2.0


class HttpState:
    def __init__(self, endpoint: str, model_names: list[str]):
        self.endpoint = endpoint
        self.client: AsyncClient | None = None
        self.model_names = model_names  # what `model` may name; the first is the default
        self.fingerprint = system_fingerprint(model_names[0])
        self.started = int(time.time())
        self.metrics = HttpMetrics()
        self.is_draining = False
        self.has_been_ready = False  # the daemon answered "ok" once: the model has loaded
        self.num_in_flight = 0
        self.reasoning: dict | None = None  # the tags the model thinks in, from the daemon once ready
        self.ctx_per_seq: int | None = None  # the context each sequence is served, from the daemon once ready
        self.batch_jobs: str | None = None  # the job runner's state at the last health check ("running", ...)

    async def connect(self, keep_trying=lambda: True) -> None:
        while self.client is None and keep_trying():
            try:
                self.client = await AsyncClient.connect(self.endpoint)
            except CbatchError as err:
                log.info("cbatch http: daemon not reachable yet (%s)", err.message)
                await asyncio.sleep(CONNECT_RETRY_S)

    async def replace_broken_client(self, keep_trying=lambda: True) -> None:
        """A client that can no longer reach the daemon (its pump died, or the daemon cut
        it off and it gave the daemon up) is closed and a new one connected; until then
        /health and new requests answer 503. Without this one broken connection would
        answer 503 for good while the daemon serves everyone else. Reconnecting stops
        when keep_trying() turns false (the daemon is gone)."""
        if self.client is None or not self.client.is_broken:
            return
        log.warning("cbatch http: the connection to the daemon broke (%s); reconnecting", self.client.broken_reason)
        broken, self.client = self.client, None
        await broken.close()
        await self.connect(keep_trying)

    async def status(self) -> str:
        """The daemon's health status: "ok", "starting" (loading the model, or restarting
        the decode worker), "draining" or "unavailable"."""
        if self.is_draining:
            return "draining"
        if self.client is None or self.client.is_broken:
            return "starting" if not self.has_been_ready else "unavailable"
        try:
            reply = await asyncio.wait_for(self.client.health(), HEALTH_TIMEOUT_S)
        except (CbatchError, asyncio.TimeoutError):
            return "unavailable"
        if reply["status"] == "ok":
            self.has_been_ready, self.reasoning = True, reply.get("reasoning")
            self.ctx_per_seq = reply.get("ctx_per_seq")
        self.batch_jobs = reply.get("batch_jobs")
        return reply["status"]

    async def refusal(self) -> CbatchError | None:
        """Why a generation request cannot be taken now. Until the model has loaded the
        daemon would hold the request for as long as loading takes: answer 503 instead.
        (A request during a worker restart is held by the daemon and served after it.)"""
        if self.is_draining:
            return CbatchError(SHUTTING_DOWN, "the server is draining")
        if not self.has_been_ready and await self.status() != "ok":
            return CbatchError(UNAVAILABLE, "the server is starting: the model is not loaded yet")
        if self.client is None or self.client.is_broken:
            return CbatchError(UNAVAILABLE, "the server is reconnecting to the daemon")
        return None

    def error(self, endpoint: str, err: CbatchError, param: str | None = None, shape=error_body) -> Response:
        """The error response, in OpenAI's shape or another API's (`shape(err, param)`)."""
        status = error_status(err.code)
        self.metrics.errors.labels(endpoint, str(status), err.code).inc()
        # A router retries these elsewhere, a client later: when the tenant's budget allows, if that is known.
        retry_after_s = RETRY_AFTER_S if err.retry_after_s is None else math.ceil(err.retry_after_s)
        headers = {"Retry-After": str(retry_after_s)} if status in (429, 503) else None
        return json_response(shape(err, param), status, headers)
