"""The host tier through llama.cpp's own state calls: greedy conversations on the tiny
model give the same tokens with the tier and without, and on gemma-3 (sliding-window
layers) a restore trimmed to its checkpoint holds exactly the state saved there."""

import random

import numpy as np
from common import GREEDY
from enginekit import generate

from cbatch.config import EngineConfig
from cbatch.workers.engine.kv.base import BLOCK_TOKENS, OP_REMOVE, OP_RESTORE, OP_SAVE
from cbatch.workers.engine.kv.host_tier import Restore, SavedPrefix
from cbatch.workers.engine.runner import LlamaRunner
from cbatch.workers.engine.sched.step_batch import BatchSpan
from cbatch.workers.engine.seq_states import WHOLE, load_state, save_state

WORDS = "river stone light garden window paper music winter market engine story number silver forest".split()


def conversation_tokens(make_engine, cache_ram_mib: int) -> tuple[list, dict]:
    engine = make_engine(parallel=2, ctx_size=2 * 1024, cache_ram_mib=cache_ram_mib)
    rng = random.Random(0)
    histories = [f"Conversation {i}: " + " ".join(rng.choice(WORDS) for _ in range(40)) for i in range(6)]
    turns = []
    for _ in range(3):
        results = generate(engine, [{"prompt": h, "max_tokens": 8, **GREEDY} for h in histories])
        turns.append([(r.token_ids, r.usage["cached_tokens"]) for r in results])
        histories = [h + r.text + " then " for h, r in zip(histories, results)]
    return turns, engine.snapshot()


def test_six_conversations_on_two_streams_give_the_same_tokens_with_the_tier_and_without(make_engine):
    with_tier, stats = conversation_tokens(make_engine, -1)
    without, stats_off = conversation_tokens(make_engine, 0)
    assert [[ids for ids, _ in turn] for turn in with_tier] == [[ids for ids, _ in turn] for turn in without]
    assert stats["host_cache_hits"] >= 8 and "host_cache_hits" not in stats_off
    assert all(cached > 0 for turn in with_tier[1:] for _, cached in turn)
    assert stats["prompt_tokens_computed"] < stats_off["prompt_tokens_computed"] / 2


def test_the_fingerprint_names_the_model_and_the_kv_layout(tiny_model_path, tiny_tools_model_path):
    def fingerprint(path, **settings):
        config = EngineConfig(model_path=path, ctx_size=4 * 256, **settings)
        runner = LlamaRunner(config, path)
        try:
            return runner.state_fingerprint(config)
        finally:
            runner.close()

    base = fingerprint(tiny_model_path)
    assert base == fingerprint(tiny_model_path)
    assert len({base, fingerprint(tiny_tools_model_path), fingerprint(tiny_model_path, parallel=2),
                fingerprint(tiny_model_path, kv_unified=True)}) == 4


class Tokens:
    """What a BatchSpan reads of a sequence (and the decode's crash mark: its request id)."""

    def __init__(self, seq_id: int, tokens: list[int]):
        self.seq_id, self.tokens, self.num_tokens = seq_id, tokens, len(tokens)
        self.request_id = seq_id

    def token_slice(self, start: int, stop: int) -> list[int]:
        return self.tokens[start:stop]


def test_a_sliding_window_restore_at_its_checkpoint_holds_the_state_saved_there(gemma_model_path):
    config = EngineConfig(model_path=gemma_model_path, parallel=2, ctx_size=2 * 2048, batch_size=512)
    runner = LlamaRunner(config, gemma_model_path)
    try:
        assert runner.has_swa
        rng = random.Random(0)
        tokens = runner.tokenize(" ".join(rng.choice(WORDS) for _ in range(1400)))[:1400]
        checkpoint, end = 69 * BLOCK_TOKENS, 81 * BLOCK_TOKENS  # 1104 and 1296: past gemma-3's 512-token window

        def decode(seq_id: int, start: int, stop: int) -> np.ndarray:
            position = start
            while position < stop:
                span = BatchSpan(Tokens(seq_id, tokens), position, min(512, stop - position))
                span.wants_logits = span.start + span.num_tokens == stop
                assert runner.decode([span]) == 0
                position += span.num_tokens
            return runner.logits(1)[0].copy()

        decode(0, 0, checkpoint)
        decode(0, checkpoint, end)
        entry = SavedPrefix([None] * (end // BLOCK_TOKENS), checkpoint_tokens=checkpoint)
        assert runner.apply_memory_ops([(OP_SAVE, 0, entry)]) == []
        saved_at_checkpoint = save_state(runner.ctx, 0, WHOLE)  # the save left sequence 0 at the checkpoint

        def restored_then_decoded(restore: Restore) -> np.ndarray:
            assert runner.apply_memory_ops([(OP_RESTORE, 1, restore)]) == []
            logits = decode(1, restore.num_tokens, restore.num_tokens + 100)
            runner.apply_memory_ops([(OP_REMOVE, 1, 0)])
            return logits

        assert load_state(runner.ctx, 1, saved_at_checkpoint, WHOLE)
        reference = decode(1, checkpoint, checkpoint + 100)
        runner.apply_memory_ops([(OP_REMOVE, 1, 0)])
        with_checkpoint = restored_then_decoded(Restore(checkpoint, entry.state, entry.checkpoint_state, end, entry))
        without = restored_then_decoded(Restore(checkpoint, entry.state, None, end, entry))
        assert np.array_equal(with_checkpoint, reference)
        assert np.abs(without - reference).max() > 1e-3  # the window's start is missing without it
        whole = restored_then_decoded(Restore(end, entry.state, None, end, entry))
        assert whole.shape == reference.shape and len(entry.state) > len(entry.checkpoint_state)
    finally:
        runner.close()
