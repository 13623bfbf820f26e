"""llama_decode with the decode worker's crash mark set around it.

A native crash inside llama_decode cannot be pinned on one request: the decode computes for
every request in its batch. So the worker marks it (the ring's CrashMark.DECODING for the
generation context, CrashMark.EMBEDDING for the embeddings'), and the supervisor puts the
requests the worker held on probation instead of blaming one (workers/daemon/crash_blame.py).
"""

import llama_cpp.llama_cpp as lc


def no_mark(value: int) -> None:
    """The mark of a runner or embedder outside a decode worker (tests, tools): none."""


def marked_decode(mark_decoding, ctx, batch) -> int:
    """lc.llama_decode(ctx, batch), with mark_decoding told 1 before it and 0 after."""
    mark_decoding(1)
    try:
        return lc.llama_decode(ctx, batch)
    finally:
        mark_decoding(0)
