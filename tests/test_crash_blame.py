"""A native crash of the decode worker is blamed on the request that caused it, never on a
bystander: a crash inside llama_decode, or with two preparers marked, quarantines no shape;
its suspects are resent on probation, one at a time, the innocents complete, and the poison
is refused (exactly) at its second crash, after which the worker stops crashing.
tests/crash_on_poison/sitecustomize.py crashes the worker on two poison prompts."""

import timeit
from pathlib import Path
from types import SimpleNamespace

import msgpack
import msgspec
import pytest
from daemonkit import submit_lines, wait_until

from cbatch.errors import CbatchError
from cbatch.ipc.ring import CrashMarks
from cbatch.params import parse_request
from cbatch.workers.daemon.crash_blame import blame_crash
from cbatch.workers.daemon.probation import MAX_PROBATION_REQUESTS, TURN_S, Probation, request_fingerprint
from cbatch.workers.daemon.quarantine import CRASHED_TWICE_MESSAGE, QUARANTINED_MESSAGE
from cbatch.workers.daemon.request_table import TrackedRequest
from cbatch.workers.messages import WorkerSubmit, encode

CRASH_ON_POISON = Path(__file__).parent / "crash_on_poison"
DECODE_POISON = "a prompt with a poison inside llama_decode"
PREPARE_POISON = "a prompt with a poison inside preparation"
LARGE_PROMPT = "large " * 400  # 2400 characters: the large-prompt preparer's, as the sitecustomize sets it
NUM_BYSTANDERS = 3
BYSTANDER_TOKENS = 1000  # still generating when the poison arrives, on a loaded machine too


def fingerprint(request_id: int, body: dict, deadline_s: float) -> int:
    submit = WorkerSubmit(parse_request(request_id, body), deadline_s)
    return request_fingerprint(submit, encode(submit)[1])


def test_the_fingerprint_is_the_request_without_its_id_or_deadline():
    body = {"prompt": "hi", "max_tokens": 3}
    request = msgspec.msgpack.encode(parse_request(1, body))  # [request id, its other fields...]
    other_fields = request[1 + len(msgpack.packb(1)):]
    assert fingerprint(1, body, 0.0) == fingerprint((1 << 63) - 1, body, 1234.5) == hash(other_fields)
    assert fingerprint(1, body, 0.0) != fingerprint(1, {**body, "prompt": "hi!"}, 0.0)
    assert fingerprint(1, body, 0.0) != fingerprint(1, {**body, "seed": 4}, 0.0)


@pytest.mark.parametrize("prompt_chars", [30, 4000])
def test_the_fingerprint_costs_less_than_parsing_and_encoding(prompt_chars):
    """Up to prompts of a few thousand characters, hashing the encoded request costs less
    than making it. Past that the hash grows with the bytes while msgspec's encoding is
    about a copy: a 1 MiB prompt's fingerprint took 0.64 ms against 0.11 ms to parse and
    encode it, beside the hundreds of milliseconds its tokenizing takes in the worker."""
    body = {"prompt": "y" * prompt_chars, "max_tokens": 64, "temperature": 0.7}
    submit = WorkerSubmit(parse_request(7, body), 12.5)
    frame = encode(submit)[1]
    admit_s = min(timeit.repeat(lambda: encode(WorkerSubmit(parse_request(7, body), 12.5)),
                                number=20, repeat=5))
    fingerprint_s = min(timeit.repeat(lambda: request_fingerprint(submit, frame), number=20, repeat=5))
    print(f"{prompt_chars} chars: parse+encode {admit_s / 20 * 1e6:.1f} us, "
          f"fingerprint {fingerprint_s / 20 * 1e6:.1f} us")
    assert fingerprint_s < 3 * admit_s


def test_requests_on_probation_take_turns_in_arrival_order():
    active = {}
    probation = Probation(active)
    first, second, third, free = (TrackedRequest(i, b"owner", False, submit=[b""], fingerprint=i) for i in range(1, 5))
    active.update({tracked.request_id: tracked for tracked in (first, second, third, free)})
    probation.put([1, 2, 3])
    assert [probation.take_turn(tracked) for tracked in (first, second, third, free)] == [True, False, False, True]
    first.submit = None  # handed to the worker
    assert probation.next_turn() == []  # its turn lasts while it runs
    del active[1]  # failed (a crash): it stays on probation, and the next one's turn comes
    assert 1 in probation and probation.next_turn() == [second]
    assert probation.take_turn(second) and not probation.take_turn(third)
    second.submit, second.finish = None, {"finish_reason": "stop"}
    del active[2]  # finished: it leaves probation
    assert probation.next_turn() == [third] and 2 not in probation
    probation.put(range(100, 100 + MAX_PROBATION_REQUESTS))
    assert len(probation) == MAX_PROBATION_REQUESTS and 1 not in probation  # the oldest go first


def test_a_turn_on_probation_ends_after_its_bound():
    """A request on probation still in the worker after TURN_S (paused by its reader, or long)
    lets the next one in, and leaves probation when it finishes all the same."""
    active, clock = {}, [0.0]
    probation = Probation(active, clock=lambda: clock[0])
    first, second = (TrackedRequest(i, b"owner", False, submit=[b""], fingerprint=i) for i in (1, 2))
    active.update({1: first, 2: second})
    probation.put([1, 2])
    assert probation.take_turn(first) and not probation.take_turn(second)
    first.submit = None
    clock[0] = TURN_S - 1
    assert probation.next_turn() == []
    clock[0] = TURN_S + 1
    assert probation.next_turn() == [second] and probation.take_turn(second)
    first.finish = {"finish_reason": "length"}
    del active[1]
    assert probation.next_turn() == [] and 1 not in probation and 2 in probation


class FakeFrontEnd:
    """What blame_crash reads and calls of the front-end, recorded."""

    def __init__(self, request_ids):
        self.requests = SimpleNamespace(active={i: TrackedRequest(i, b"o", False, fingerprint=i) for i in request_ids})
        self.probation = Probation(self.requests.active)
        self.quarantined, self.failed = [], []
        self.quarantine = SimpleNamespace(add=self.quarantined.append, add_request=self.quarantined.append)

    def fail(self, tracked, code, message):
        self.failed.append(tracked.request_id)


@pytest.mark.parametrize("marks, suspects", [
    (CrashMarks((7,), False, ()), None),  # one preparer's request alone: its shape is quarantined
    (CrashMarks((7,), False, (), is_several=True), [5, 6, 7]),  # beside a joint mask fill: no one is blamed
    (CrashMarks((), True, (5,)), [5]),  # inside llama_decode: its batch only
    (CrashMarks((7,), True, (5, 6)), [7, 5, 6]),
    (CrashMarks((), False, ()), [5, 6, 7]),  # nothing marked: every request the worker held
])
def test_who_a_crash_puts_on_probation(marks, suspects):
    frontend = FakeFrontEnd([5, 6, 7])
    blame_crash(marks, frontend)
    if suspects is None:
        assert len(frontend.quarantined) == 1 and frontend.failed == [7] and len(frontend.probation) == 0
    else:
        assert frontend.quarantined == [] and sorted(suspects) == [i for i in (5, 6, 7) if i in frontend.probation]


def outcome(chunks):
    """How a request ended: its finish reason, or the error it failed with."""
    try:
        return list(chunks)[-1].finish_reason
    except CbatchError as err:
        return err


def new_worker_pid(client, old_pid: int) -> int:
    wait_until(lambda: client.health()["worker_pid"] not in (0, old_pid), timeout_s=120)
    return client.health()["worker_pid"]


def test_a_crash_inside_llama_decode_catches_the_poison_not_its_batch_mates(tiny_model_path, start_daemon,
                                                                            monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(CRASH_ON_POISON))
    daemon = start_daemon(tiny_model_path, "--parallel", "4", "--ctx-size", str(4 * 1024))
    bystanders = [{"prompt": f"a bystander {i}", "max_tokens": BYSTANDER_TOKENS, "ignore_eos": True}
                  for i in range(NUM_BYSTANDERS)]
    poison = {"prompt": DECODE_POISON, "max_tokens": 4}
    with daemon.client() as client:
        first_pid = client.health()["worker_pid"]
        readers = [client.stream(**body) for body in bystanders]
        for reader in readers:
            next(reader)  # generating when the poison comes
        results = [outcome(reader) for reader in [*readers, client.stream(**poison)]]
        assert all(isinstance(err, CbatchError) and err.code == "worker_restarted" for err in results), results
        second_pid = new_worker_pid(client, first_pid)
        assert client.generate(prompt="a default request", max_tokens=3).usage["completion_tokens"] == 3

        # Every caller sends its request again, all at once: the suspects run one at a time.
        streams = [client.submit(**body) for body in [*bystanders, poison]]
        *bystander_ends, poison_end = [outcome(client.read(stream)) for stream in streams]
        assert bystander_ends == ["length"] * NUM_BYSTANDERS
        assert isinstance(poison_end, CbatchError) and poison_end.code == "invalid_request"
        assert poison_end.message == CRASHED_TWICE_MESSAGE
        third_pid = new_worker_pid(client, second_pid)

        with pytest.raises(CbatchError) as refused:  # refused at once, the worker untouched
            client.generate(**poison)
        assert refused.value.code == "invalid_request" and refused.value.message == CRASHED_TWICE_MESSAGE
        for body in bystanders:
            assert client.generate(**body).finish_reason == "length"
        assert client.health()["worker_pid"] == third_pid
    log = daemon.log()
    assert "its shape is quarantined" not in log and log.count("that exact request is quarantined") == 1


def test_requests_queued_or_paused_in_the_worker_are_not_suspects(tiny_model_path, start_daemon, monkeypatch):
    """A crash inside llama_decode puts only that decode's requests on probation: those queued
    in the worker behind a full batch, and a paused one in a slot, were in no batch; sent again,
    they are not held for turns, while the poison alone is caught at its second crash."""
    monkeypatch.setenv("PYTHONPATH", str(CRASH_ON_POISON))
    daemon = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 8192), "--park-after", "3600")
    holders = [{"prompt": f"a holder {i}", "max_tokens": 7000, "ignore_eos": True} for i in range(2)]
    queued = [{"prompt": f"queued {i}", "max_tokens": 8, "ignore_eos": True, "priority": "batch"} for i in range(3)]
    poison = {"prompt": DECODE_POISON, "max_tokens": 4}
    with daemon.client() as client:
        first_pid = client.health()["worker_pid"]
        held = [client.submit(**body) for body in holders]  # never read: they pause, and keep the slots
        streams = [client.submit(**body) for body in queued] + [client.submit(**poison)]
        wait_until(lambda: (stats := client.stats())["num_queued"] == len(streams) and stats["num_paused"] == 2,
                   timeout_s=120)
        client.cancel(held[0].request_id)  # the poison (interactive) takes that slot first
        # The poison's end first: reading the paused holder would let it back into the batch.
        results = [outcome(client.read(stream)) for stream in [streams[-1], held[1], *streams[:-1]]]
        assert all(isinstance(err, CbatchError) and err.code == "worker_restarted" for err in results), results
        second_pid = new_worker_pid(client, first_pid)

        resent = [client.submit(**body) for body in queued]
        assert [outcome(client.read(stream)) for stream in resent] == ["length"] * len(queued)
        poison_end = outcome(client.stream(**poison))  # on probation: caught at its second crash
        assert isinstance(poison_end, CbatchError) and poison_end.message == CRASHED_TWICE_MESSAGE
        new_worker_pid(client, second_pid)
    log = daemon.log()
    assert "crashed inside llama_decode; 1 requests go on probation" in log, log


def test_a_crash_with_two_preparers_marked_blames_no_shape(tiny_model_path, start_daemon, monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", str(CRASH_ON_POISON))
    monkeypatch.setenv("CBATCH_TEST_CRASHED_FILE", str(tmp_path / "crashed"))
    daemon = start_daemon(tiny_model_path, "--parallel", "2", "--ctx-size", str(2 * 4096))
    poison = {"prompt": PREPARE_POISON, "max_tokens": 4, "top_k": 7}  # a shape of its own
    large = {"prompt": LARGE_PROMPT, "max_tokens": 4, "ignore_eos": True}  # default parameters
    with daemon.client() as client:
        first_pid = client.health()["worker_pid"]
        large_stream = client.submit(**large)  # marked once the poison is, and still preparing when it crashes
        poisoned = client.submit(**poison)
        results = [outcome(client.read(stream)) for stream in (large_stream, poisoned)]
        assert all(isinstance(err, CbatchError) and err.code == "worker_restarted" for err in results), results
        second_pid = new_worker_pid(client, first_pid)
        assert client.generate(prompt="a default request", max_tokens=3).usage["completion_tokens"] == 3

        streams = [client.submit(**body) for body in (poison, large)]  # resent: on probation, one at a time
        poison_end, large_end = [outcome(client.read(stream)) for stream in streams]
        assert large_end == "length"
        assert isinstance(poison_end, CbatchError) and poison_end.code == "invalid_request"
        assert poison_end.message == QUARANTINED_MESSAGE  # alone in its preparer: its own shape
        third_pid = new_worker_pid(client, second_pid)
        assert client.generate(**large).finish_reason == "length"
        assert client.generate(prompt="a default request", max_tokens=3).usage["completion_tokens"] == 3
        assert client.health()["worker_pid"] == third_pid
    assert daemon.log().count("its shape is quarantined") == 1


def test_a_batch_file_with_a_poison_line_completes_every_other_line(tiny_model_path, start_daemon, monkeypatch,
                                                                    tmp_path):
    """cbatch-submit sends a line again after worker_restarted: its batch-mates complete, the
    poison line alone is answered with invalid_request."""
    monkeypatch.setenv("PYTHONPATH", str(CRASH_ON_POISON))
    daemon = start_daemon(tiny_model_path, "--parallel", "4", "--ctx-size", str(4 * 1024))
    lines = [{"id": f"b{i}", "prompt": f"a bystander {i}", "max_tokens": 200, "ignore_eos": True} for i in range(6)]
    lines.insert(3, {"id": "poison", "prompt": DECODE_POISON, "max_tokens": 4})
    done, results = submit_lines(daemon.env, lines, tmp_path, timeout_s=600)
    assert done.returncode == 1, done.stderr  # the poison line fails, alone
    assert all(results[f"b{i}"]["finish_reason"] == "length" for i in range(6)), results
    assert results["poison"]["error"]["code"] == "invalid_request"
    assert results["poison"]["error"]["message"] == CRASHED_TWICE_MESSAGE
    log = daemon.log()
    assert "its shape is quarantined" not in log and log.count("that exact request is quarantined") == 1
