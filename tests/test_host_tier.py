"""The host-memory tier below the KV streams, without a model: its index and LRU, what
the stream manager saves and restores through it, and conversations through the engine
on the fake runner (exact outputs), sliding-window models included."""

import pytest
from common import GREEDY
from enginekit import collect, generate, run_to_completion, submit
from test_engine_cache import fake_engine

from cbatch.workers.engine.kv.base import BLOCK_TOKENS, OP_REMOVE, OP_RESTORE, OP_SAVE
from cbatch.workers.engine.kv.host_tier import MIN_RESTORE_TOKENS, HostTier
from cbatch.workers.engine.kv.streams import StreamCacheManager

B = BLOCK_TOKENS


def blocks(tokens):
    return [tuple(tokens[i:i + B]) for i in range(0, len(tokens) - len(tokens) % B, B)]


def slicer(tokens):
    return lambda start, stop: tokens[start:stop]


def save(tier, tokens, checkpoint=0, num_bytes=100):
    """Plan and settle a save of `tokens` (whole blocks), as the runner would fill it."""
    entry = tier.plan_save(blocks(tokens), checkpoint)
    if entry is not None:
        entry.state = bytearray(num_bytes)
        entry.checkpoint_state = bytearray(10) if entry.checkpoint_tokens else None
    tier.settle()
    return entry


def test_a_prompt_restores_its_longest_saved_prefix_leaving_its_last_token():
    tier = HostTier(max_bytes=1 << 20, has_swa=False)
    conversation = list(range(1, 6 * B + 1))
    save(tier, conversation)
    longer = conversation + [7, 8, 9]
    assert tier.match(slicer(longer), len(longer)).num_tokens == 6 * B
    assert tier.match(slicer(conversation), len(conversation)).num_tokens == 5 * B  # the last token is computed
    diverging = conversation[:3 * B + 4] + [0] * 40
    assert tier.match(slicer(diverging), len(diverging)).num_tokens == 3 * B  # trimmed: no sliding window
    assert tier.match(slicer([5] * 80), 80) is None


def test_a_longer_state_replaces_the_one_it_extends_and_a_covered_one_is_not_saved():
    tier = HostTier(max_bytes=1 << 20, has_swa=False)
    turn = list(range(1, 4 * B + 1))
    save(tier, turn)
    assert tier.plan_save(blocks(turn[:2 * B]), 0) is None  # the saved turn holds it
    save(tier, turn + list(range(100, 100 + 2 * B)))
    stats = tier.snapshot()
    assert (stats["host_cache_entries"], stats["host_cache_replaced"], stats["host_cache_bytes"]) == (1, 1, 100)


def test_memory_is_bounded_least_recently_used_out_first():
    tier = HostTier(max_bytes=250, has_swa=False)
    first, second, third = ([n] * (4 * B) for n in (1, 2, 3))
    save(tier, first)
    save(tier, second)
    tier.on_restored(tier.match(slicer(first + [0]), 4 * B + 1))  # first is now the more recently used
    save(tier, third)
    assert tier.match(slicer(second + [0]), 4 * B + 1) is None
    assert tier.match(slicer(first + [0]), 4 * B + 1) is not None
    stats = tier.snapshot()
    assert (stats["host_cache_bytes"], stats["host_cache_evictions"], stats["host_cache_entries"]) == (200, 1, 2)


def test_a_failed_save_leaves_nothing_behind():
    tier = HostTier(max_bytes=1 << 20, has_swa=False)
    tokens = [4] * (4 * B)
    assert tier.plan_save(blocks(tokens), 0) is not None
    tier.settle()  # the runner filled no state
    assert tier.snapshot()["host_cache_entries"] == 0 and tier.match(slicer(tokens + [1]), 4 * B + 1) is None


def test_a_sliding_window_state_restores_at_its_end_or_its_checkpoint_only():
    tier = HostTier(max_bytes=1 << 20, has_swa=True)
    conversation = list(range(1, 8 * B + 1))
    save(tier, conversation, checkpoint=5 * B)
    whole = tier.match(slicer(conversation + [1]), 8 * B + 1)
    assert (whole.num_tokens, whole.checkpoint_state) == (8 * B, None)
    at_checkpoint = conversation[:6 * B] + [0] * 40  # diverges after the checkpoint
    restore = tier.match(slicer(at_checkpoint), len(at_checkpoint))
    assert restore.num_tokens == 5 * B and restore.checkpoint_state is not None
    before = conversation[:4 * B] + [0] * 40  # diverges before it: nothing is usable
    assert tier.match(slicer(before), len(before)) is None


def streams_with_tier(num_streams=2, has_swa=False, max_bytes=1 << 20):
    tier = HostTier(max_bytes, has_swa)
    return StreamCacheManager(num_streams, 1024, True, tier), tier


def run(kv, tokens, num_prompt_tokens=None):
    """Admit, compute, commit and release a sequence; returns what admit gave."""
    placed = kv.admit(slicer(tokens), len(tokens))
    kv.commit(placed[0], slicer(tokens), len(tokens))
    kv.release(placed[0], slicer(tokens), len(tokens), True, num_prompt_tokens or len(tokens))
    return placed


def settle(kv, tier):
    """Apply the ops as the runner would: fill saved entries; returns the ops."""
    ops = kv.take_ops()
    for op in ops:
        if op[0] == OP_SAVE:
            op[2].state = bytearray(64)
            op[2].checkpoint_state = bytearray(8) if op[2].checkpoint_tokens else None
    tier.settle()
    return ops


def test_a_stream_given_to_another_conversation_is_saved_first_and_restored_when_it_returns():
    kv, tier = streams_with_tier(num_streams=1)
    a, b = [1] * (6 * B), [2] * (6 * B)
    run(kv, a)
    settle(kv, tier)
    seq_id, _ = run(kv, b)  # takes a's stream
    ops = settle(kv, tier)
    assert [op[0] for op in ops[:2]] == [OP_SAVE, OP_REMOVE] and ops[0][2].num_tokens == 6 * B
    returning = a + [3] * 10
    assert kv.admit(slicer(returning), len(returning)) == (seq_id, 6 * B)
    ops = settle(kv, tier)
    assert [op[0] for op in ops] == [OP_SAVE, OP_REMOVE, OP_RESTORE, OP_REMOVE]  # b's prefix is saved in turn
    assert ops[2][2].num_tokens == 6 * B and ops[-1] == (OP_REMOVE, seq_id, 6 * B)
    assert tier.snapshot()["host_cache_hits"] == 1 and kv.num_tokens_reused == 6 * B


def test_the_device_wins_unless_the_saved_prefix_is_longer_by_a_restores_worth():
    kv, tier = streams_with_tier(num_streams=2)
    p, q, r = [1] * (4 * B), [2] * (4 * B), [3] * (2 * B)
    run(kv, p + q)
    run(kv, [9] * (3 * B))
    run(kv, [8] * (3 * B))  # takes p + q's stream: saved, 8 blocks
    run(kv, p + r)  # a free stream now holds p
    settle(kv, tier)
    near = p + q[:B] + [7] * 5  # the saved state has 5 blocks of it, a free stream 4: not worth a restore
    assert MIN_RESTORE_TOKENS > B
    assert kv.admit(slicer(near), len(near))[1] == 4 * B
    assert all(op[0] != OP_RESTORE for op in settle(kv, tier))
    far = p + q + [7] * 5  # 8 blocks saved, 4 on the device
    assert kv.admit(slicer(far), len(far))[1] == 8 * B
    assert any(op[0] == OP_RESTORE for op in settle(kv, tier))


def test_questions_on_one_document_save_no_near_copies_of_it_but_a_conversation_is_saved():
    kv, tier = streams_with_tier(num_streams=2)
    document = [1] * (40 * B)
    for i in range(6):  # each question's stream holds the document and a two-block tail of its own
        run(kv, document + [100 + i] * (2 * B))
    assert all(op[0] != OP_SAVE for op in settle(kv, tier)) and tier.snapshot()["host_cache_entries"] == 0
    conversation = [1] * (4 * B) + [7] * (20 * B)  # a short shared system prompt, then its own history
    run(kv, conversation)
    run(kv, [1] * (4 * B) + [8] * (20 * B))
    run(kv, [1] * (4 * B) + [9] * (20 * B))  # takes the conversation's stream
    assert any(op[0] == OP_SAVE and op[2].num_tokens == 24 * B for op in settle(kv, tier))


def test_a_restored_sliding_window_stream_serves_no_shorter_prefix_in_place():
    kv, tier = streams_with_tier(num_streams=2, has_swa=True)
    conversation = [1] * (6 * B)
    run(kv, conversation)
    run(kv, [2] * (2 * B))
    run(kv, [3] * (2 * B))  # conversation's stream is saved and reused
    settle(kv, tier)
    returning = conversation + [4] * B + [0]
    seq_id, reused = run(kv, returning)
    assert reused == 6 * B
    settle(kv, tier)
    # Its stream holds 7 blocks, but the sliding-window cells of the first 6 only near their end.
    shorter = conversation[:4 * B] + [5] * 20
    _, reused = kv.admit(slicer(shorter), len(shorter))
    assert reused == 0


@pytest.mark.parametrize("unified, has_swa", [(False, False), (False, True), (True, False)],
                         ids=["streams", "streams-sliding-window", "pool"])
def test_sixteen_conversations_on_four_slots_compute_only_their_new_tokens(unified, has_swa):
    """Outputs exact against the cache off; on the fake runner a sliding-window decode that
    reaches a cell a restore did not bring fails the test. The pool keeps few cached cells
    here, so that its conversations come back from the host tier too."""
    on = fake_engine(unified=unified, has_swa=has_swa, num_cells=4 * 512, cache_tokens=300)
    off = fake_engine(unified=False, prefix_cache=False, num_cells=4 * 512)
    system = "system: answer briefly and kindly. " * 2  # shared: three blocks every slot may hold
    histories = [f"{system}conversation {i} " + "abcdefgh"[i % 8] * (90 + 7 * i) for i in range(16)]
    computed = []
    for turn in range(4):
        bodies = [{"prompt": h, "max_tokens": 9, **GREEDY} for h in histories]
        before = on.snapshot()["prompt_tokens_computed"]
        with_tiers, without = generate(on, bodies), generate(off, bodies)
        assert [r.text for r in with_tiers] == [r.text for r in without]
        computed.append(on.snapshot()["prompt_tokens_computed"] - before)
        if turn:  # at most the new text and the answer's tail beyond its last whole block
            assert all(r.usage["prompt_tokens"] - r.usage["cached_tokens"] <= 12 + 9 + 2 * B for r in with_tiers)
        histories = [h + r.text + f" turn {turn} " for h, r in zip(histories, with_tiers)]
    stats = on.snapshot()
    assert stats["host_cache_hits"] >= 3 * 12 and computed[1] < computed[0] / 4
    assert stats["kv_cache_lookups"] == 64


def test_a_restore_llama_cpp_refuses_is_recomputed_with_the_same_output():
    engine = fake_engine(unified=False, num_cells=2 * 512, parallel=2)
    histories = [f"talk {i} " + "xyz"[i % 3] * 100 for i in range(4)]
    first = generate(engine, [{"prompt": h, "max_tokens": 5, **GREEDY} for h in histories])
    returning = [{"prompt": h + r.text + " more", "max_tokens": 5, **GREEDY} for h, r in zip(histories, first)]
    engine.runner.num_failing_restores = 2
    results = generate(engine, returning)
    reference = generate(fake_engine(unified=False, prefix_cache=False), returning)
    assert [r.text for r in results] == [r.text for r in reference]
    assert sorted(r.usage["cached_tokens"] == 0 for r in results) == [False, False, True, True]


def test_a_preempted_batch_sequence_parks_its_state_in_the_tier_and_resumes_from_it():
    engine = fake_engine(unified=False, num_cells=2 * 512, parallel=2)
    batch = [{"prompt": f"batch line {i} " + "mnop"[i] * 200, "max_tokens": 30, "priority": "batch", **GREEDY}
             for i in range(2)]
    ids = [submit(engine, body) for body in batch]
    results = {}
    for _ in range(10):  # both prefilled and generating
        collect(results, engine.step())
    for i in range(2):  # interactive requests take both slots; the batch states go to the tier
        submit(engine, {"prompt": f"question {i} " + "qrst"[i] * 150, "max_tokens": 5, **GREEDY})
    run_to_completion(engine, results)
    reference = generate(fake_engine(unified=False, num_cells=2 * 512, parallel=2), batch)
    assert [results[i].text for i in ids] == [r.text for r in reference]
    stats = engine.snapshot()
    assert stats["num_preemptions"] == 2 and stats["host_cache_hits"] == 2
    assert stats["prompt_tokens_computed"] < 2 * 212 + 2 * 162 + 2 * 2 * B  # the resumed ones recomputed little
