"""Cancelling many queued requests at once (a drain, a client with a full queue that
goes away) costs one pass over the queue, not one search of it per request."""

import random
import time

from common import GREEDY
from fakerunner import FakeRunner

from cbatch.config import MAX_QUEUE, EngineConfig
from cbatch.params import parse_request
from cbatch.workers.engine.engine import Engine


def test_cancelling_a_full_queue_takes_one_step_no_longer_than_filling_it():
    parallel = 4
    config = EngineConfig(parallel=parallel, ctx_size=4096, batch_size=64, max_queue=MAX_QUEUE)
    engine = Engine(config, FakeRunner(4096, parallel, config.num_seq_ids, unified=config.kv_unified))
    request_ids = random.Random(7).sample(range(1, 1 << 62), parallel + MAX_QUEUE)  # as random as the clients' ids
    running, queued = request_ids[:parallel], request_ids[parallel:]
    for request_id in running:
        engine.add_request(parse_request(request_id, {"prompt": "runs", "max_tokens": 100, **GREEDY}))
    engine.step()
    started = time.perf_counter()
    for request_id in queued:
        engine.add_request(parse_request(request_id, {"prompt": "queued", "max_tokens": 4, **GREEDY}))
    fill_s = time.perf_counter() - started
    for request_id in queued:
        engine.cancel(request_id)
    started = time.perf_counter()
    events = engine.step()
    cancel_s = time.perf_counter() - started
    assert sorted(event.request_id for event in events if event.finish_reason == "cancelled") == sorted(queued)
    assert {event.request_id for event in events if not event.finish_reason} == set(running)  # they ran on
    assert not engine.scheduler.waiting
    # Quadratic (a search of the queue per cancel) took about five times the filling here.
    assert cancel_s < 2 * fill_s, f"cancelling took {cancel_s:.2f} s, filling {fill_s:.2f} s"
