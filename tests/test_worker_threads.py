"""The decode worker's threads, through a real worker process and a stand-in for the
front-end (a ROUTER the test binds): a request the preparer fails on costs only that
request, a dead I/O thread ends the worker, as the supervisor needs to notice it, a
command it cannot read ends its request, a cancel never waits behind a long
preparation, and preparing runs at a lower priority than decoding."""

import multiprocessing
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from common import worker_submit

from cbatch.config import EngineConfig
from cbatch.ipc.records import record_request_ids
from cbatch.ipc.ring import create_ring
from cbatch.params import Request
from cbatch.protocol import MsgType
from cbatch.workers.decode.plan import WorkerPlan, worker_identity
from cbatch.workers.decode.preparer import PREPARE_NICE_INCREMENT
from cbatch.workers.decode.worker import run_decode_worker
from cbatch.workers.engine.engine import Engine
from cbatch.workers.engine.runner import LlamaRunner
from cbatch.workers.messages import (
    WorkerCancel,
    WorkerEvents,
    WorkerPause,
    WorkerReady,
    WorkerReject,
    WorkerStop,
    WorkerSubmit,
    decode,
    encode,
)

GENERATION = 1
REPLY_TIMEOUT_S = 60.0  # the first reply includes loading the model
FAULTY_PROMPT = "the preparer fails on this one"
SLOW_PROMPT = "the preparer takes a minute over this one"
MAX_TOKENIZED_CHARS = 100_000


def run_worker_with_a_slow_prepare(plan: WorkerPlan) -> None:
    """The worker, with prepare taking a minute over one prompt, as over a huge grammar."""
    prepare = Engine.prepare

    def slow_prepare(engine, request, deadline_s):
        if request.prompt == SLOW_PROMPT:
            time.sleep(60)
        return prepare(engine, request, deadline_s)

    Engine.prepare = slow_prepare
    run_decode_worker(plan)


def run_worker_that_refuses_to_tokenize_huge_prompts(plan: WorkerPlan) -> None:
    tokenize = LlamaRunner.tokenize

    def checked_tokenize(runner, text):
        if len(text) > MAX_TOKENIZED_CHARS:
            raise KeyError("a prompt that cannot fit was tokenized")
        return tokenize(runner, text)

    LlamaRunner.tokenize = checked_tokenize
    run_decode_worker(plan)


def run_worker_with_a_faulty_prepare(plan: WorkerPlan) -> None:
    """The worker, with prepare failing as a bug would (not a CbatchError or ValueError)
    on one prompt."""
    prepare = Engine.prepare

    def faulty_prepare(engine, request, deadline_s):
        if request.prompt == FAULTY_PROMPT:
            raise KeyError("a bug")
        return prepare(engine, request, deadline_s)

    Engine.prepare = faulty_prepare
    run_decode_worker(plan)


def run_worker_whose_io_thread_fails_on_a_pause(plan: WorkerPlan) -> None:
    """The worker, its I/O thread failing as a bug of its own would on a WorkerPause (every
    command it gets is validated as it is decoded, so a front-end's bad message cannot)."""
    from cbatch.workers.decode import io_thread

    decode_command = io_thread.decode

    def faulty_decode(frames):
        message = decode_command(frames)
        if isinstance(message, WorkerPause):
            raise KeyError("a bug")
        return message

    io_thread.decode = faulty_decode
    run_decode_worker(plan)


class FrontEndStandIn:
    """Binds the control socket, creates the ring and starts one real worker process."""

    def __init__(self, model_path: str, target=run_decode_worker, ctx_size: int = 512):
        self.workdir = Path(tempfile.mkdtemp(prefix="cbt-"))  # short enough for socket paths
        self.zctx = zmq.Context()
        self.socket = self.zctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        control = f"ipc://{self.workdir}/control.sock"
        self.socket.bind(control)
        self.ring = create_ring(f"cbt-{os.getpid()}-{secrets.token_hex(4)}", 64)
        plan = WorkerPlan(EngineConfig(model_path=model_path, parallel=1, ctx_size=ctx_size, batch_size=64), control,
                          f"ipc://{self.workdir}/tick.sock", self.ring.name, GENERATION)
        self.process = multiprocessing.get_context("spawn").Process(target=target, args=(plan,))
        self.process.start()

    def send(self, message) -> None:
        self.socket.send_multipart([worker_identity(GENERATION), *encode(message)])

    def recv(self, of_type: type):
        """The next message of of_type (stats-only events, which an idle worker sends every
        half second, are skipped)."""
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0 and self.socket.poll(left_ms), f"no {of_type.__name__} from the worker"
            _, *frames = self.socket.recv_multipart()
            message = decode(frames)
            if isinstance(message, of_type) and (not isinstance(message, WorkerEvents) or message.records):
                return message

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.zctx.destroy(linger=0)
        self.ring.close()
        self.ring.unlink()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def front_end(tiny_model_path):
    started = []

    def start(target=run_decode_worker, ctx_size: int = 512) -> FrontEndStandIn:
        started.append(FrontEndStandIn(tiny_model_path, target, ctx_size))
        started[-1].recv(WorkerReady)
        return started[-1]

    yield start
    for stand_in in started:
        stand_in.close()


def pack_fields(msg_type: MsgType, fields: list) -> list[bytes]:
    """A worker message's frames from its fields as given, right or wrong."""
    return [bytes((msg_type,)), msgspec.msgpack.encode(fields)]


def run_to_finish(stand_in: FrontEndStandIn, request_id: int) -> str:
    stand_in.send(worker_submit(request_id, {"prompt": "x", "max_tokens": 3, "temperature": 0, "ignore_eos": True}))
    while True:
        step = stand_in.recv(WorkerEvents)
        assert set(record_request_ids(step.records)) == {request_id}
        if step.ends:
            return step.ends[0][1]


def test_an_unexpected_failure_to_prepare_costs_only_that_request(front_end):
    stand_in = front_end(run_worker_with_a_faulty_prepare)
    stand_in.send(worker_submit(1, {"prompt": FAULTY_PROMPT, "max_tokens": 3}))
    assert stand_in.recv(WorkerReject) == WorkerReject(1, "internal",
                                                       "the worker failed to prepare this request: KeyError")
    # The preparer lives on: the next submits run, on the same worker.
    assert run_to_finish(stand_in, 2) == "length"
    assert run_to_finish(stand_in, 3) == "length"
    stand_in.send(WorkerStop())
    stand_in.process.join(10)
    assert stand_in.process.exitcode == 0


def test_a_dead_io_thread_ends_the_worker(front_end):
    stand_in = front_end(run_worker_whose_io_thread_fails_on_a_pause)
    assert run_to_finish(stand_in, 1) == "length"
    stand_in.send(WorkerPause(1, True))
    # Exit code 1, the same as any worker death the supervisor restarts after.
    stand_in.process.join(10)
    assert stand_in.process.exitcode == 1


def test_a_command_the_worker_cannot_read_ends_its_request(front_end):
    stand_in = front_end()
    # A submit whose request's prompt is a number: it names its request, which must still end.
    stand_in.socket.send_multipart([worker_identity(GENERATION), *pack_fields(MsgType.WORKER_SUBMIT, [[7, 42]])])
    reject = stand_in.recv(WorkerReject)
    assert (reject.request_id, reject.code) == (7, "internal")
    assert run_to_finish(stand_in, 8) == "length"  # and the worker serves on


def test_a_message_the_worker_takes_no_command_from_is_dropped(front_end):
    stand_in = front_end()
    stand_in.send(WorkerReady(1, "not a command", 0, ""))  # the worker's own message, sent back by a front-end bug
    assert run_to_finish(stand_in, 8) == "length"  # the worker serves on
    assert stand_in.process.is_alive()


def test_a_submit_the_worker_cannot_rebuild_ends_only_its_request(front_end):
    stand_in = front_end()
    stand_in.send(WorkerSubmit(Request(7)))  # as a front-end bug would: neither a prompt nor messages
    reject = stand_in.recv(WorkerReject)
    assert (reject.request_id, reject.code) == (7, "internal"), reject.message
    assert run_to_finish(stand_in, 8) == "length"  # and the worker serves on


def test_a_cancel_does_not_wait_behind_a_long_preparation(front_end):
    stand_in = front_end(run_worker_with_a_slow_prepare, ctx_size=8192)
    stand_in.send(worker_submit(1, {"prompt": "x", "max_tokens": 8000, "temperature": 0, "ignore_eos": True}))
    assert record_request_ids(stand_in.recv(WorkerEvents).records)[0] == 1  # running
    stand_in.send(worker_submit(2, {"prompt": SLOW_PROMPT, "max_tokens": 3}))
    stand_in.send(WorkerCancel(1))
    stand_in.send(WorkerCancel(2))  # overtakes its submit: kept until the request is prepared
    while True:
        finishes = stand_in.recv(WorkerEvents).ends
        if finishes:
            break
    assert [(request_id, finish_reason) for request_id, finish_reason, *_ in finishes] == [(1, "cancelled")]
    assert finishes[0][2]["completion_tokens"] < 8000


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(front_end):
    stand_in = front_end(run_worker_that_refuses_to_tokenize_huge_prompts)
    stand_in.send(worker_submit(1, {"prompt": "many words " * 50_000, "max_tokens": 3}))
    reject = stand_in.recv(WorkerReject)
    assert (reject.request_id, reject.code) == (1, "prompt_too_long"), reject.message
    assert "550000 bytes" in reject.message
    assert run_to_finish(stand_in, 2) == "length"


def test_preparing_runs_at_a_lower_priority_than_decoding(front_end):
    stand_in = front_end()
    pid = stand_in.process.pid
    nice_by_thread = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        nice_by_thread[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[16])
    assert nice_by_thread[pid] == os.getpriority(os.PRIO_PROCESS, 0)  # the decode loop
    # the large prompts' preparer and the compiles' one; the small requests' runs at the loop's priority
    assert sum(1 for nice in nice_by_thread.values() if nice == nice_by_thread[pid] + PREPARE_NICE_INCREMENT) == 2
