"""The decode worker's publisher numbers each step's records per request, into a real ring."""

from types import SimpleNamespace

import zmq

from cbatch.ipc.records import FINISH_LENGTH, FINISH_TIMEOUT, FLAG_LAST, TokenEvent, relay_rows
from cbatch.ipc.ring import RingReader
from cbatch.workers.decode.publisher import EventPublisher


class SentEvents:
    """Takes what the publisher sends the front-end, as the worker's I/O thread would."""

    def __init__(self):
        self.messages = []

    def send(self, message) -> None:
        self.messages.append(message)


def test_two_events_of_one_request_in_a_step_are_numbered_as_one_stream(ring):
    # A fork samples its first token from the last decode's row, then its deadline passes
    # in the same step: the engine makes a token event and a finish event for one request.
    reader = RingReader(ring)
    for request_id in (7, 8):
        reader.watch(request_id)
    no_stats = SimpleNamespace(snapshot=dict)
    sent = SentEvents()
    with zmq.Context() as zctx, zctx.socket(zmq.PUB) as tick:
        tick.setsockopt(zmq.LINGER, 0)
        publisher = EventPublisher(no_stats, no_stats, ring, sent, tick)
        publisher.publish([TokenEvent(7, [11], "a"), TokenEvent(8, [21], "b")])
        publisher.publish([TokenEvent(7, [12], "c"), TokenEvent(8, [22], "d", "length", {"completion_tokens": 2}),
                           TokenEvent(7, [], "", "timeout", {"completion_tokens": 2})])

    records = reader.poll()
    seven = [r for r in records if r.request_id == 7]
    assert [(r.index, r.token_id, r.finish) for r in seven] == [(0, 11, 0), (1, 12, FINISH_TIMEOUT)]
    assert seven[-1].flags & FLAG_LAST and seven[-1].count == 2
    eight = [r for r in records if r.request_id == 8]
    assert [(r.index, r.finish, r.count) for r in eight] == [(0, 0, 0), (1, FINISH_LENGTH, 2)]
    # The front-end hears the same records, and one end for each request.
    last_step = sent.messages[-1]
    assert [row[:2] for row in relay_rows(last_step.records)] == [[1, 12], [1, 22]]
    assert [end[:3] for end in last_step.ends] == [[7, "timeout", {"completion_tokens": 2}],
                                                   [8, "length", {"completion_tokens": 2}]]
