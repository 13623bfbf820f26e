"""The one exception type users catch, and the stable error codes it carries.

Codes are part of the public contract: clients branch on them, so they never change
meaning. Messages are for people and say which setting or field to change.
"""

INVALID_REQUEST = "invalid_request"
QUEUE_FULL = "queue_full"
PROMPT_TOO_LONG = "prompt_too_long"
WORKER_RESTARTED = "worker_restarted"
UNAVAILABLE = "unavailable"
DECODE_FAILED = "decode_failed"
SHUTTING_DOWN = "shutting_down"
NOT_FOUND = "not_found"
INTERNAL = "internal"
INVALID_CONFIG = "invalid_config"
VERSION_MISMATCH = "version_mismatch"
ENDPOINT_IN_USE = "endpoint_in_use"
UNAUTHORIZED = "unauthorized"  # HTTP without the API key
FORBIDDEN = "forbidden"  # HTTP: a valid API key that may not use this path (/metrics without metrics=1)
DEADLINE_EXCEEDED = "deadline_exceeded"  # the request's timeout passed while it was queued
MODEL_EMBEDS_ONLY = "model_embeds_only"  # a generation request to an embedding-only model (BERT and kin)
TOO_LARGE = "too_large"  # HTTP: a request body past the server's bound (413)
RATE_LIMITED = "rate_limited"  # the API key's tenant is past one of its limits; `retry_after_s` says when to retry
# A request a draining daemon ended before it finished: not an answer, the same request sent again succeeds.
SHUTDOWN_MESSAGE = "the daemon shut down before the request finished; send it again"


class CbatchError(Exception):
    """An error with a stable machine-readable `code` and a human `message`."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # when the same request may succeed (rate_limited); None = not known

    def to_dict(self) -> dict:
        if self.retry_after_s is None:
            return {"code": self.code, "message": self.message}
        return {"code": self.code, "message": self.message, "retry_after_s": self.retry_after_s}


# Exit codes of the console scripts and of the daemon, stable as the error codes are.
EXIT_OK = 0  # done; a daemon that drained after SIGTERM/SIGINT
EXIT_FAILED = 1  # some lines failed; a query failed; a daemon that cannot serve (a taken endpoint or port,
#                  a model it cannot load, a worker that cannot start)
EXIT_USAGE = 2  # bad arguments (argparse's own code), an input or output file that cannot be used
EXIT_UNREACHABLE = 3  # no daemon answered at the endpoint
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM (128 + SIGINT, as a shell reports Ctrl-C)
