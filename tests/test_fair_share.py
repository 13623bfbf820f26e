"""Fair share among tenants in the waiting queue, without a model: order by served tokens
over weight, FIFO within a tenant, no credit banked while idle, parsing of the keys file."""

import pytest

from cbatch.api_keys import parse_keys, tenant_of_key
from cbatch.errors import INVALID_CONFIG, CbatchError
from cbatch.params import SamplingParams
from cbatch.workers.engine.sched.waiting_queue import WaitingQueue
from cbatch.workers.engine.sequence import Sequence

request_ids = iter(range(1, 1 << 30))


def seq(tenant: str, weight: float = 1.0, num_prompt: int = 10, is_batch: bool = False) -> Sequence:
    return Sequence(next(request_ids), [1] * num_prompt, SamplingParams(), tenant=tenant, tenant_weight=weight,
                    is_batch=is_batch)


def admit(queue: WaitingQueue) -> Sequence:
    """Pop the next one and charge its prompt, as the scheduler does when it is admitted."""
    admitted = queue.popleft()
    queue.share.on_admitted(admitted)
    return admitted


def test_the_least_served_tenant_goes_first_and_each_keeps_its_order():
    queue = WaitingQueue(max_running=4, max_queue=100, max_batch_queue=100)
    heavy = [seq("heavy") for _ in range(6)]
    light = [seq("light", weight=2.0) for _ in range(3)]
    for item in heavy + light:
        queue.add(item)
    order = [admit(queue) for _ in range(9)]
    # light costs half as much per token: two of its requests for each of heavy's, while it has any
    assert [item.tenant for item in order[:6]] == ["heavy", "light", "light", "heavy", "light", "heavy"]
    assert [item for item in order if item.tenant == "heavy"] == heavy  # FIFO within a tenant
    assert [item for item in order if item.tenant == "light"] == light


def test_generated_tokens_count_and_interactive_still_goes_before_batch():
    queue = WaitingQueue(max_running=4, max_queue=100, max_batch_queue=100)
    first, second = seq("a"), seq("b")
    queue.add(first)
    queue.add(second)
    queue.add(batch := seq("c", is_batch=True))
    assert admit(queue) is first
    queue.share.charge_decoded([first] * 5)  # a is now ahead by its prompt and 5 tokens
    queue.add(again := seq("a"))
    assert [admit(queue), admit(queue), admit(queue)] == [second, again, batch]


def test_an_idle_tenant_banks_no_credit():
    queue = WaitingQueue(max_running=4, max_queue=1000, max_batch_queue=1000)
    for _ in range(50):
        queue.add(seq("busy"))
    for _ in range(40):
        admit(queue)  # busy was served 400 tokens while idle waited for nothing
    late = [seq("idle") for _ in range(3)]
    for item in late:
        queue.add(item)
    order = [admit(queue).tenant for _ in range(6)]
    assert order.count("idle") == 3 and order[:2] != ["idle", "idle"]  # it takes turns, it does not catch up


@pytest.mark.parametrize("line, message", [
    ("alice", "line 2: expected 'NAME KEY"), ("alice weight=2", "line 2: the key is missing"),
    ("al!ce k", "line 2: the name 'al!ce'"), ("bob k2", "line 2: the name 'bob' is given twice"),
    ("carol k1", "line 2: 'carol' has another tenant's key"), ("carol k weight=0", "line 2: weight must be"),
    ("carol k max_concurrent=-1", "line 2: max_concurrent must be"), ("carol k color=red", "line 2: unknown option"),
    ("carol k metrics=yes", "line 2: metrics must be 0 or 1"),
])
def test_a_bad_line_is_invalid_config_naming_it(line, message):
    with pytest.raises(CbatchError) as caught:
        parse_keys(f"bob k1  # a comment\n{line}\n", "keys.txt")
    assert caught.value.code == INVALID_CONFIG and caught.value.message.startswith(f"keys.txt {message}")


def test_keys_name_their_tenants():
    keys = parse_keys("# teams\n\nbob k1 weight=2.5 max_concurrent=3\ncarol k2 tokens_per_min=600 metrics=1\n",
                      "keys.txt")
    assert (keys["bob"].weight, keys["bob"].max_concurrent, keys["carol"].tokens_per_min) == (2.5, 3, 600)
    assert (keys["bob"].metrics, keys["carol"].metrics) == (False, True)
    assert [tenant_of_key(keys, key) for key in (b"k1", b"k2", b"k3", b"")] == ["bob", "carol", None, None]
