"""The decode worker process: the only process that loads the model.

Three threads, so that nothing but decoding runs on the loop's:
    WorkerIO (sockets) -> RequestPreparer (tokenize, chat template, constraint) -> engine loop
                       -> (cancels, stop) --------------------------------------^
Embedding requests take the same path (the preparer tokenizes them); the loop runs at
most one embedding decode (workers/engine/embedder.py) between two generation steps.
The main thread runs the engine loop and writes tokens into the shared-memory ring; a
slow or chatty front-end, a 1 MB prompt or a large grammar never stalls a decode step
(ctypes releases the GIL inside llama.cpp's tokenizer, and a large prompt is prepared at
a lower priority, beside the others). A cancel goes straight to the loop, never behind a long preparation; one that
overtakes its submit is kept until the prepared request arrives. After each step the loop publishes
the records, sends a tick on its PUB socket (waking local readers), and hands the step's
events to the front-end.
"""

import os
import signal
from typing import Callable

import llama_cpp  # noqa: F401  before zmq, see cbatch/__init__.py
import zmq

from cbatch.errors import INTERNAL
from cbatch.ipc.records import TokenEvent
from cbatch.ipc.ring import CrashMark, attach_ring
from cbatch.workers.decode.commands import CommandHandler
from cbatch.workers.decode.io_thread import WorkerIO
from cbatch.workers.decode.plan import WorkerPlan
from cbatch.workers.decode.preparer import PREPARE_NICE_INCREMENT, RequestPreparer
from cbatch.workers.decode.publisher import EventPublisher
from cbatch.workers.engine.chat_template import tool_format
from cbatch.workers.engine.embedder import Embedder
from cbatch.workers.engine.engine import Engine
from cbatch.workers.messages import WorkerFailed, WorkerReady

# An embedding decode beside generation takes about a step's time, at least this (a
# llama_decode call has a cost of its own, and the tiny steps of a small model on a GPU
# would leave embeddings almost no room).
MIN_EMBED_STEP_S = 0.002
# With nothing generating, an embedding decode takes this long at most: long enough that a
# decode's fixed cost is a small share, short enough that a request arriving meanwhile
# waits little for its first step.
IDLE_EMBED_STEP_S = 0.2


def run_decode_worker(plan: WorkerPlan) -> None:
    # Ctrl-C, and SIGTERM sent to the whole process group (systemd, kill -TERM -PGID), reach
    # this process too; the supervisor drains and then stops it with WORKER_STOP.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    zctx = zmq.Context()
    io = WorkerIO(zctx, plan)
    io.start()
    tick = zctx.socket(zmq.PUB)
    tick.setsockopt(zmq.LINGER, 0)
    engine = ring = embedder = None
    try:
        try:
            tick.bind(plan.tick_endpoint)
            ring = attach_ring(plan.ring_name)
            engine = Engine(plan.engine, mark_sampling=ring.marker(CrashMark.SAMPLING))
            embedder = Embedder(engine.runner, plan.engine)
            # Each marking thread has its own mark (the ring's CrashMark): who crashed the worker.
            engine.runner.mark_decoding = ring.decode_marker(CrashMark.DECODING)
            embedder.mark_decoding = ring.decode_marker(CrashMark.EMBEDDING)
        except Exception as exc:
            io.send(WorkerFailed(str(exc), getattr(exc, "code", INTERNAL)))
            raise SystemExit(1)
        publisher = EventPublisher(engine, embedder, ring, io, tick)
        start_preparers(engine, embedder, io, ring)
        io.send(ready_message(engine, embedder, plan))
        handler = CommandHandler(engine, embedder, io, io.commands, publisher)
        run_engine_loop(engine, embedder, handler.apply_pending, publisher.publish, io.send)
    finally:
        io.close()
        tick.close()
        if ring is not None:
            ring.close()
        if embedder is not None:  # its context before the model it uses
            embedder.close()
        if engine is not None:
            engine.close()
        zctx.term()


def start_preparers(engine: Engine, embedder: Embedder, io: WorkerIO, ring) -> None:
    """The preparer threads, each with its own crash mark; then structured output's
    vocabulary adapter, before READY: llguidance builds it holding the interpreter (2-3 s
    for gemma's 262k tokens), which would stall the first steps."""
    if not engine.runner.is_embedding_only:
        io.needs_compile = lambda request: engine.structured.needs_compile(request.params)
    for source, mark, nice_increment in ((io.inbox, CrashMark.PREPARING, 0),
                                         (io.large_inbox, CrashMark.PREPARING_LARGE, PREPARE_NICE_INCREMENT),
                                         (io.compile_inbox, CrashMark.COMPILING, PREPARE_NICE_INCREMENT)):
        RequestPreparer(engine, embedder, source, io.commands, ring.marker(mark), nice_increment).start()
    if not engine.runner.is_embedding_only:
        engine.structured.tokenizer()


def ready_message(engine: Engine, embedder: Embedder, plan: WorkerPlan) -> WorkerReady:
    """What the front-end and, through it, every client learn of the model once it is loaded."""
    description = f"{engine.description}, embeddings by {embedder.pooling} pooling"
    return WorkerReady(os.getpid(), description, engine.ctx_per_seq, engine.prefix_cache_note, engine.reasoning,
                       {**tool_format(engine.runner.jinja_template),
                        "takes_images": engine.runner.vision is not None,
                        "n_ctx_train": llama_cpp.llama_model_n_ctx_train(engine.runner.model),
                        "keeps_billing_header": plan.engine.keep_billing_header})


def run_engine_loop(engine: Engine, embedder: Embedder, apply_pending: Callable[[bool], bool],
                    publish: Callable[[list[TokenEvent]], None], send: Callable) -> None:
    """Drive the engine and the embedder until `apply_pending` returns False.

    `apply_pending(wait_s)` applies pending add/cancel commands to the engine (waiting up
    to wait_s for one when both are idle: until a parking or a deadline is due) and says
    whether to go on;
    `publish(events)` gets every step's events, possibly none; `send` takes the
    embedder's replies. With overlap on, the next step is already decoding while
    `publish`, `apply_pending` and an embedding decode run.
    """
    while apply_pending(0.0 if engine.has_work or embedder.has_work else engine.idle_wait_s):
        if embedder.has_work:  # one embedding decode between two generation steps, at most
            # Beside generation it takes about as long as a step (embedder.py).
            step_s = engine.stats.recent_step_s
            budget_s = max(step_s, MIN_EMBED_STEP_S) if engine.has_work else IDLE_EMBED_STEP_S
            for reply in embedder.step(budget_s, step_s):
                send(reply)
            if not engine.has_work:
                publish([])  # the liveness beat an embedding-only load would otherwise never give
        if engine.has_work:
            publish(engine.step())  # even an empty step: publishing is also the liveness beat
