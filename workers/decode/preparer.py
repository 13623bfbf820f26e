"""The decode worker's preparer threads: tokenizing, chat templates and grammars run here,
off the decode loop's thread (ctypes releases the GIL inside llama.cpp's tokenizer).

Three of them. Requests with a large prompt go to one that runs at a lower scheduling
priority than the decode threads, so tokenizing a 1 MB prompt never takes a core from
llama.cpp's threads while they wait at their barrier, and the requests behind it are not
held up by it. Requests whose constraint must be compiled (none kept for its text) go to
one of their own, also at the lower priority (llguidance compiles without the GIL, so
only the cores are contended), so a large schema's compile (a second or more) neither
delays the small requests behind it nor slows the steps beside it. The others go to one
at normal priority: a thread of low priority that holds the GIL when it is descheduled
stalls the decode loop too, which on a busy host cost short requests tens of seconds.
Each keeps its requests' arrival order."""

import math
import os
import queue
import threading
import traceback
from collections.abc import Callable

from cbatch.errors import INTERNAL, INVALID_REQUEST, CbatchError
from cbatch.workers.engine.embedder import Embedder, EmbedJob
from cbatch.workers.engine.engine import Engine
from cbatch.workers.engine.sequence import Sequence
from cbatch.workers.messages import (
    WorkerCount,
    WorkerCounted,
    WorkerEmbed,
    WorkerEmbedded,
    WorkerReject,
    WorkerSubmit,
)

# Added to the large prompts' and the compiles' threads' nice value: when one and decoding want the same
# core, the decode threads get about nine tenths of it (the kernel's weights 1024 against 110).
PREPARE_NICE_INCREMENT = 10
# Prompt characters from which a request is prepared by the low-priority thread: about
# 16k tokens, some milliseconds of tokenizing.
MIN_LARGE_PROMPT_CHARS = 1 << 16


def is_large_prompt(submit: WorkerSubmit) -> bool:
    """The prompt, or the chat's text (messages, calls' arguments and the offered tools),
    judged on the I/O thread; a request with images is large too (the vision encoder runs
    in its preparation). One with neither a prompt nor messages (a front-end bug) is not
    large: the preparer rejects it, and the I/O thread lives on."""
    request = submit.request
    if request.prompt is not None:
        num_chars = len(request.prompt)
    else:
        num_chars = sum(len(message.content) + sum(len(call.arguments) for call in message.tool_calls)
                        for message in request.messages or ())
        num_chars += sum(len(tool.description) + len(tool.parameters) for tool in request.offered_tools)
    return num_chars >= MIN_LARGE_PROMPT_CHARS or bool(request.images)


class RequestPreparer(threading.Thread):
    """Turns each SUBMIT from the I/O thread into a prepared Sequence (or a REJECT) in
    `outbox`, and each EMBED into an EmbedJob (or its error reply), in arrival order, at
    nice_increment below the process's priority."""

    def __init__(self, engine: Engine, embedder: Embedder, source: queue.SimpleQueue, outbox: queue.SimpleQueue,
                 mark_preparing: Callable[[int], None], nice_increment: int = 0):
        super().__init__(name="worker-prepare", daemon=True)
        self._engine, self._embedder, self._source, self.outbox = engine, embedder, source, outbox
        self._mark_preparing = mark_preparing  # its own crash mark: each request id before its preparation, 0 after
        self._nice_increment = nice_increment

    def run(self) -> None:
        if self._nice_increment:
            lower_this_threads_priority(self._nice_increment)
        while True:
            prepared = self._prepare(self._source.get())
            self._mark_preparing(0)
            self.outbox.put(prepared)

    def _prepare(self, submit: WorkerSubmit | WorkerEmbed | WorkerCount
                 ) -> Sequence | WorkerReject | EmbedJob | WorkerEmbedded | WorkerCounted:
        if isinstance(submit, WorkerEmbed):
            return self._prepare_embed(submit)
        if isinstance(submit, WorkerCount):
            return self._count(submit)
        try:
            self._mark_preparing(submit.request_id)
            # The front-end decided the deadline (its own or the priority's default, from the
            # request's arrival there); 0 = none.
            return self._engine.prepare(submit.request, submit.deadline_s or math.inf)
        except CbatchError as err:
            return rejection(submit.request_id, err)
        except Exception as err:
            # A bug costs this request an `internal` error, not the worker: prepare reads only
            # the model, never engine state, so nothing the running requests rely on can be
            # broken, and ending the worker would fail all of them. The thread must live on:
            # without it every later submit would wait forever while the heartbeat (stamped by
            # the loop) kept the watchdog content.
            traceback.print_exc()
            return WorkerReject(submit.request_id, INTERNAL, f"the worker failed to prepare this request: "
                                                             f"{type(err).__name__}")


    def _count(self, count: WorkerCount) -> WorkerCounted:
        return _answered(lambda: WorkerCounted(count.count_id, self._engine.count_prompt_tokens(count.request)),
                         lambda code, message: WorkerCounted(count.count_id, code=code, message=message),
                         "count this request's tokens")

    def _prepare_embed(self, embed: WorkerEmbed) -> EmbedJob | WorkerEmbedded:
        return _answered(lambda: self._embedder.prepare(embed),
                         lambda code, message: WorkerEmbedded(embed.embed_id, code=code, message=message),
                         "prepare these embeddings")


def _answered(prepare, refusal, what: str):
    """prepare()'s result, or refusal(code, message) for its error: a bug costs this one
    question an `internal` error, never the preparer thread (see _prepare)."""
    try:
        return prepare()
    except CbatchError as err:
        return refusal(err.code, err.message)
    except Exception as err:
        traceback.print_exc()
        return refusal(INTERNAL, f"the worker failed to {what}: {type(err).__name__}")


def lower_this_threads_priority(increment: int) -> None:
    """On Linux a nice value belongs to a thread: setpriority on this thread's own id
    leaves the process's other threads (the decode loop, llama.cpp's) as they are."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except OSError:
        pass  # not allowed here: preparing then competes as an equal


def rejection(request_id: int, err: Exception) -> WorkerReject:
    if isinstance(err, CbatchError):
        return WorkerReject(request_id, err.code, err.message)
    return WorkerReject(request_id, INVALID_REQUEST, str(err))
