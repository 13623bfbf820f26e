"""A quarantined shape is the parsed sampling parameters but the seed: the same request
written another way (a default spelled out, 1 for 1.0, another prompt or seed) is refused
too, and one with other parameters is not."""

import pytest

from cbatch.errors import CbatchError
from cbatch.params import parse_request
from cbatch.workers.daemon.quarantine import QUARANTINED_MESSAGE, Quarantine

CRASHED = {"prompt": "x", "max_tokens": 4, "grammar": 'root ::= "a"', "min_tokens": 2}


def test_the_same_parameters_written_another_way_are_refused():
    quarantine = Quarantine()
    quarantine.add(quarantine.admit(parse_request(1, CRASHED)))
    for body in ({**CRASHED, "prompt": "another", "seed": 9}, {**CRASHED, "top_k": 40, "temperature": 0.8},
                 {**CRASHED, "repeat_penalty": 1, "stop": [], "priority": "batch", "tenant_weight": 3.0},
                 {"messages": [{"role": "user", "content": "hi"}],
                  **{k: v for k, v in CRASHED.items() if k != "prompt"}}):
        with pytest.raises(CbatchError) as refused:
            quarantine.admit(parse_request(2, body))
        assert refused.value.message == QUARANTINED_MESSAGE


def test_other_parameters_are_admitted():
    quarantine = Quarantine()
    quarantine.add(quarantine.admit(parse_request(1, CRASHED)))
    for body in ({**CRASHED, "min_tokens": 3}, {**CRASHED, "grammar": 'root ::= "b"'},
                 {"prompt": "x", "max_tokens": 4}):
        assert quarantine.admit(parse_request(2, body)) == parse_request(2, body).params
