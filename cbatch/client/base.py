"""What both clients share: the endpoint check, request bodies, and everything that does not wait."""

import os

from cbatch.client.session import Session
from cbatch.client.streams import Completion, RequestStream
from cbatch.errors import CbatchError, UNAVAILABLE
from cbatch.params import expand_choices

CONNECT_TIMEOUT_S = 10.0


def unreachable(endpoint: str) -> CbatchError:
    return CbatchError(UNAVAILABLE, f"no cbatch daemon answers at {endpoint}; start cbatch-worker, "
                                    "or point --endpoint / CBATCH_ENDPOINT at it")


def check_endpoint(endpoint: str) -> None:
    # An ipc:// endpoint with no socket file cannot answer: fail now instead of after a timeout.
    if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://"):]):
        raise unreachable(endpoint)


def _request_body(prompt, messages, params) -> dict:
    body = dict(params)
    if prompt is not None:
        body["prompt"] = prompt
    if messages is not None:
        body["messages"] = messages
    return body


def choice_items(prompt, messages, params) -> list[dict]:
    """The batch items of a request with `n`: one per choice, named by its index."""
    return [{**body, "id": i} for i, body in enumerate(expand_choices(_request_body(prompt, messages, params)))]


def raise_any(results: list) -> list[Completion]:
    for result in results:
        if isinstance(result, CbatchError):
            raise result
    return results


class ClientBase:
    """What both clients share: everything that does not wait. Subclasses set
    self._session and decide how to wait."""

    _session: Session

    @property
    def info(self) -> dict:
        """The daemon's handshake: model, parallel, ctx_per_seq, use_ring, ring_name."""
        return dict(self._session.welcome)

    def submit(self, prompt: str | None = None, messages: list | None = None, **params) -> RequestStream:
        """Send a request; read its chunks with read(stream)."""
        return self._session.submit(_request_body(prompt, messages, params))

    def cancel(self, request_id: int) -> None:
        """End a request early: its stream ends with finish_reason "cancelled" and keeps
        the tokens produced so far."""
        self._session.cancel(request_id)

    def stream(self, prompt: str | None = None, messages: list | None = None, **params):
        """Chunks as tokens arrive (an iterator, or an async one); the last one has
        finish_reason and usage."""
        return self.read(self.submit(prompt, messages, **params))
