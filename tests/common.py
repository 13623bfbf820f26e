"""What many tests share: request parameters, a free port, children that take Ctrl-C, and
a request as the front-end hands it to the decode worker."""

import signal
import socket

import msgspec

from cbatch.params import parse_request
from cbatch.workers.messages import WorkerSubmit

# Greedy and never ending early: a request's token count is exactly its max_tokens.
GREEDY = {"temperature": 0, "ignore_eos": True}


def without_cached(usage: dict) -> dict:
    """A usage's counts that do not depend on what a KV cache held when the request ran
    (native `cached_tokens`, OpenAI's `prompt_tokens_details`)."""
    return {name: value for name, value in usage.items() if name not in ("cached_tokens", "prompt_tokens_details")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_sigint() -> None:
    """preexec_fn of a child a test interrupts with SIGINT: a test run started in the
    background has SIGINT ignored (as a shell does for `cmd &`), which a child inherits and
    Python then keeps, so the interrupt would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def worker_submit(request_id: int, body: dict, tenant_weight: float = 1.0) -> WorkerSubmit:
    """A request as the front-end hands it to the decode worker: parsed, the weight set."""
    return WorkerSubmit(msgspec.structs.replace(parse_request(request_id, body), tenant_weight=tenant_weight))
