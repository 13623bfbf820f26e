"""CPU per request on its way from a client to the decode worker, outside the decode loop:
the front-end's part (unpack the client's SUBMIT body, parse and check it into the Request
struct, set the tenant's weight, encode the worker's message, take the crash fingerprint)
and the decode worker's part (decode that message into the Request the engine prepares).

Each body is run --repeat times in a row, best of --rounds; the figures are process CPU
microseconds per request. Prints a table with a row per body, and the CPU this run used.

    .venv/bin/python scripts/bench.py request_path
"""

import time

import msgpack
import msgspec

from benches.options import bench_parser
from benches.report import Table, note
from cbatch.params import parse_request
from cbatch.workers.daemon.probation import request_fingerprint
from cbatch.workers.messages import WorkerSubmit, decode, encode

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
BODIES = {
    "short prompt": {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0.7},
    "chat, 4 messages": {"messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Name a colour."},
                                      {"role": "assistant", "content": "Blue."},
                                      {"role": "user", "content": "Another?"}],
                         "max_tokens": 32, "temperature": 0, "stop": ["\n\n", "User:"], "seed": 7},
    "every parameter": {"prompt": "Fill in the form:", "max_tokens": 128, "temperature": 0.9, "top_k": 20,
                        "top_p": 0.9, "min_p": 0.1, "repeat_penalty": 1.1, "presence_penalty": 0.5,
                        "frequency_penalty": 0.5, "seed": 3, "stop": ["END"], "json_schema": SCHEMA,
                        "logprobs": 5, "logit_bias": {"13": -100, "42": 5}, "min_tokens": 2,
                        "priority": "batch", "timeout": 30, "tenant": "team-a"},
    "64 KiB prompt": {"prompt": "word " * 13_107, "max_tokens": 16},
}


def front_end(request_id: int, frame: bytes) -> tuple[WorkerSubmit, list[bytes], int]:
    body = msgpack.unpackb(frame, raw=False)["body"]
    request = msgspec.structs.replace(parse_request(request_id, body), tenant_weight=2.0)
    submit = WorkerSubmit(request, 1234.5)
    frames = encode(submit)
    return submit, frames, request_fingerprint(submit, frames[1])


def worker(frames: list[bytes]):
    return decode(frames).request


def us_per_request(run, repeat: int, rounds: int) -> float:
    best_s = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(repeat):
            run()
        best_s = min(best_s, time.process_time() - started)
    return best_s / repeat * 1e6


def main() -> None:
    parser = bench_parser(__doc__, model=None, repeat=2000, rounds=5)
    args = parser.parse_args()
    started = time.process_time()
    figures = Table("CPU per request, the best of --rounds", "body", "front-end us", "worker us", widths={"body": 16})
    for name, body in BODIES.items():
        frame = msgpack.packb({"request_id": 7, "body": body}, use_bin_type=True)
        repeat = max(1, args.repeat // (100 if len(frame) > 10_000 else 1))
        _, frames, _ = front_end(7, frame)
        assert worker(frames) == msgspec.structs.replace(parse_request(7, body), tenant_weight=2.0)
        front_us = us_per_request(lambda: front_end(7, frame), repeat, args.rounds)
        worker_us = us_per_request(lambda: worker(frames), repeat, args.rounds)
        figures.row(name, front_us, worker_us)
    note(f"CPU used by this run: {time.process_time() - started:.1f} s (one process, one thread)")

