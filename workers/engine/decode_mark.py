"""llama_decode with the decode worker's crash mark set around it.

A native crash inside llama_decode cannot be pinned on one request: the decode computes for
every request in its batch. So the worker marks it with the batch's request ids (the ring's
CrashMark.DECODING and its roster for the generation context, CrashMark.EMBEDDING for the
embeddings'), and the supervisor puts those requests on probation instead of blaming one
(workers/daemon/crash_blame.py).
"""

import llama_cpp.llama_cpp as lc


def no_mark(request_ids) -> None:
    """The mark of a runner or embedder outside a decode worker (tests, tools): none."""


def marked_decode(mark_decoding, request_ids: list[int], ctx, batch) -> int:
    """lc.llama_decode(ctx, batch), with mark_decoding told the batch's request ids before it
    and () after."""
    mark_decoding(request_ids)
    try:
        return lc.llama_decode(ctx, batch)
    finally:
        mark_decoding(())
