"""What the scheduler and the front-end keep per tenant: fair share off (`--no-fair-share`)
admits in arrival order (in the scheduler, and through a real daemon), and tenants that
come and go leave bounded state (fair-share counters, usage counters, token buckets)."""

import itertools

import pytest

from cbatch.params import SamplingParams
from cbatch.workers.daemon.flags import config_from_args, make_parser
from cbatch.workers.daemon.tenant_ledger import MAX_IDLE_UNLISTED, TenantLedger
from cbatch.workers.engine.kv.pool import PoolCacheManager
from cbatch.workers.engine.sched.scheduler import Scheduler
from cbatch.workers.engine.sequence import SeqStatus, Sequence

request_ids = itertools.count(1)
OUTPUT_TOKENS = 3


def make_seq(tenant: str) -> Sequence:
    request_id = next(request_ids)
    prompt = [(7 * request_id + k) % 30000 for k in range(8)]  # no two alike: none forks another
    return Sequence(request_id, prompt, SamplingParams(), max_output_tokens=OUTPUT_TOKENS, tenant=tenant)


def make_scheduler(num_slots: int, fair_share: bool = True) -> Scheduler:
    kv = PoolCacheManager(1 << 16, num_slots, True, max_cached_cells=0)
    return Scheduler(kv, num_slots, 64, 10000, 10000, fair_share=fair_share)


def step(sched: Scheduler) -> list[Sequence]:
    """One step as the engine makes it, sampling a token for each sequence that wants one;
    the sequences admitted in it, in admission order."""
    before = {id(seq) for seq in sched.running}
    spans = sched.schedule()
    admitted = [seq for seq in sched.running if id(seq) not in before]
    sched.on_computed_batch(spans)
    for span in spans:
        seq = span.seq
        if span.wants_logits and seq.status is SeqStatus.DECODING:
            seq.output_ids.append(1 + len(seq.output_ids))
            if len(seq.output_ids) >= OUTPUT_TOKENS:
                sched.finish(seq, keep_cached=False)
    return admitted


def admission_order(fair_share: bool) -> list[str]:
    sched = make_scheduler(1, fair_share)
    for tenant in ["heavy"] * 8 + ["light"] * 2:  # heavy's backlog is queued before light's first request
        sched.add(make_seq(tenant))
    order = []
    while sched.has_work:
        order += [seq.tenant for seq in step(sched)]
    return order


def test_without_fair_share_a_backlogged_tenants_earlier_requests_go_first():
    assert admission_order(fair_share=True)[:4] == ["heavy", "light", "heavy", "light"]
    assert admission_order(fair_share=False) == ["heavy"] * 8 + ["light"] * 2


@pytest.mark.parametrize("fair_share", [True, False])
def test_a_daemon_without_fair_share_serves_the_backlog_first(start_daemon, tiny_model_path, fair_share):
    """One slot; heavy queues six requests, then light two. The slot serves them one at a
    time, so the order they finish in is the order they were admitted in."""
    daemon = start_daemon(tiny_model_path, "--parallel", "1", *([] if fair_share else ["--no-fair-share"]))
    tenants = ["heavy"] * 6 + ["light"] * 2
    items = [{"prompt": f"order {i}", "max_tokens": 16, "ignore_eos": True, "tenant": tenant}
             for i, tenant in enumerate(tenants)]
    finished = []
    with daemon.client() as client:
        for position, chunk in client.stream_batch(items, max_in_flight=len(items)):
            assert not isinstance(chunk, Exception), chunk
            if chunk.finish_reason:
                finished.append(tenants[position])
    if fair_share:
        assert "light" in finished[:3], finished  # it takes turns with heavy's backlog
    else:
        assert finished == tenants  # behind all of heavy's


@pytest.mark.parametrize("flags, fair_share", [([], True), (["--no-fair-share"], False), (["--fair-share"], True)])
def test_the_flag_reaches_the_engine_config(flags, fair_share):
    assert config_from_args(make_parser().parse_args(flags)).engine.fair_share is fair_share


@pytest.mark.parametrize("has_backlog", [False, True])
def test_tenants_that_come_and_go_leave_bounded_scheduler_state(has_backlog):
    """2,000 tenants of one to three requests each, arriving one every three steps on 4 slots,
    beside a tenant that always has requests waiting (the queue never runs dry) or alone
    (it does, again and again): counters are kept for the tenants with work and a few more."""
    sched = make_scheduler(4)
    share = sched.waiting.share
    most = 0
    for number in range(2000):
        for _ in range(1 + number % 3):
            sched.add(make_seq(f"t{number}"))
        while has_backlog and sum(seq.tenant == "backlog" for seq in sched.waiting) < 8:
            sched.add(make_seq("backlog"))
        for _ in range(3):  # two requests in three steps, while 4 slots end about one a step: no pile-up
            step(sched)
            most = max(most, share.num_entries)
    while sched.has_work:
        step(sched)
    assert most <= 12, most  # without pruning: 2,000
    assert share.num_entries == 0 and not share.num_held  # an idle scheduler keeps nothing of them


def test_an_idle_tenant_is_forgotten_only_when_it_would_start_from_the_same_place():
    """A tenant served more than the others stays ahead after it goes idle: it is kept
    until the virtual time passes its counter, and then it would start there anyway."""
    sched = make_scheduler(1)
    share = sched.waiting.share
    sched.add(make_seq("early"))
    for _ in range(6):
        sched.add(make_seq("busy"))
    while any(seq.tenant == "early" for seq in [*sched.running, *sched.waiting]):
        step(sched)
    assert "early" in share.counters and share.counters["early"] > share.virtual_time  # ahead: kept
    while share.virtual_time < share.counters.get("early", 0.0):
        step(sched)
    assert "early" not in share.counters  # passed: it would start at the virtual time, as a new one


def test_usage_of_tenants_the_keys_file_does_not_name_is_bounded(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("named key-named tokens_per_min=600\ngone key-gone tokens_per_min=600\n")
    ledger = TenantLedger(str(keys_file))
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    for tenant in ("named", "gone", "default"):
        ledger.admit(tenant, 0.0)
        ledger.release(tenant)
        ledger.on_finished(tenant, usage, 0.0)
    ledger.admit("running", 0.0)  # in flight throughout
    keys_file.write_text("named key-named tokens_per_min=600\n")
    ledger.reload()  # "gone" is one more unlisted tenant now
    for number in range(10 * MAX_IDLE_UNLISTED):
        ledger.admit(f"caller{number}", 1.0)
        ledger.release(f"caller{number}")
        ledger.on_finished(f"caller{number}", usage, 1.0)
        assert len(ledger.usage) <= 3 + 2 * MAX_IDLE_UNLISTED
    stats = ledger.stats()
    assert stats["named"]["num_requests"] == stats["default"]["num_requests"] == 1  # kept, however old
    assert stats["running"]["num_in_flight"] == 1 and "gone" not in stats and "caller0" not in stats
    assert stats[f"caller{10 * MAX_IDLE_UNLISTED - 1}"] == {"num_requests": 1, "num_prompt_tokens": 3,
                                                           "num_generated_tokens": 2, "num_in_flight": 0}
    assert set(ledger._buckets) == {"named"}  # a removed key's bucket went with it
