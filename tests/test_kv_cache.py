"""The KV manager and prefix index without a model.

`FakeKV` applies the manager's memory operations to a model of llama.cpp's unified pool
(cells owned by sets of sequence ids, each cell holding the token computed into it), so
the tests check what llama.cpp would hold, not only the manager's own counts.
"""

import random

import pytest

from cbatch.workers.engine.kv.base import BLOCK_TOKENS, OP_COPY
from cbatch.workers.engine.kv.pool import PoolCacheManager

B = BLOCK_TOKENS


class FakeKV:
    def __init__(self):
        self.cells: dict[int, list[list]] = {}  # seq_id -> cell per position; a cell is [token]

    def apply(self, ops):
        for op in ops:
            if op[0] == OP_COPY:
                _, src, dst, start, end = op
                assert len(self.cells.setdefault(dst, [])) == start, "a copy continues where dst ends"
                self.cells[dst] += self.cells[src][start:end]
            else:
                _, seq_id, start = op
                self.cells[seq_id] = self.cells.get(seq_id, [])[:start]

    def compute(self, seq_id, tokens):
        held = self.cells.setdefault(seq_id, [])
        held += [[t] for t in tokens[len(held):]]

    def num_live_cells(self):
        return len({id(c) for held in self.cells.values() for c in held})

    def tokens(self, seq_id):
        return [c[0] for c in self.cells.get(seq_id, [])]


def run(kv: PoolCacheManager, fake: FakeKV, tokens: list[int]) -> int:
    """Admit a sequence, compute all its tokens, and check llama.cpp would hold them."""
    placed = kv.admit(lambda a, b: tokens[a:b], len(tokens))
    assert placed is not None
    seq_id, num_reused = placed
    fake.apply(kv.take_ops())
    assert fake.tokens(seq_id) == tokens[:num_reused], "a reused prefix holds exactly the prompt's tokens"
    fake.compute(seq_id, tokens)
    kv.commit(seq_id, lambda a, b: tokens[a:b], len(tokens))
    return seq_id


def finish(kv, fake, seq_id, tokens, keep=True):
    kv.release(seq_id, lambda a, b: tokens[a:b], len(tokens), keep)
    fake.apply(kv.take_ops())


def test_a_shared_prefix_is_copied_not_recomputed_and_its_cells_count_once():
    kv, fake = PoolCacheManager(1024, 16, True, 512), FakeKV()
    system = list(range(100, 100 + 4 * B))
    a = run(kv, fake, system + [1, 2, 3])
    b = run(kv, fake, system + [4, 5])
    assert kv.num_tokens_reused == 4 * B
    assert fake.cells[a][: 4 * B] == fake.cells[b][: 4 * B]  # the same cells, not copies
    assert kv.num_cells_used == fake.num_live_cells() == 4 * B + 3 + 2


def test_a_wholly_cached_prompt_still_computes_its_last_token():
    kv, fake = PoolCacheManager(1024, 16, True, 512), FakeKV()
    prompt = list(range(3 * B))
    finish(kv, fake, run(kv, fake, prompt), prompt)
    seq_id, reused = kv.admit(lambda a, b: prompt[a:b], len(prompt))
    assert reused == 2 * B  # the block holding the last token is computed again


def test_finished_prefixes_stay_cached_until_their_cells_are_needed_lru_first():
    kv, fake = PoolCacheManager(8 * B, 16, True, 8 * B), FakeKV()
    old, new = [1] * (3 * B), [2] * (3 * B)
    finish(kv, fake, run(kv, fake, old), old)
    finish(kv, fake, run(kv, fake, new), new)
    assert kv.num_cached_holders == 2 and kv.num_cells_evictable == kv.num_cells_used == 6 * B
    big = [3] * (4 * B)  # needs 4 blocks, 2 are free: the least recently used prefix goes
    run(kv, fake, big)
    assert kv.num_cached_holders == 1
    assert kv.num_reusable(lambda a, b: old[a:b], len(old)) == 0
    assert kv.num_reusable(lambda a, b: new[a:b], len(new)) == 2 * B
    assert kv.num_cells_used == fake.num_live_cells() == 7 * B


def test_no_room_even_after_eviction_changes_nothing():
    kv, fake = PoolCacheManager(4 * B, 16, True, 4 * B), FakeKV()
    prompt = [5] * (3 * B)
    run(kv, fake, prompt)  # running: not evictable
    before = (kv.num_cells_used, kv.num_cells_evictable, kv.ops)
    assert kv.admit(lambda a, b: [6] * (b - a), 2 * B) is None
    assert (kv.num_cells_used, kv.num_cells_evictable, kv.ops) == before


def test_a_prefix_held_by_a_running_sequence_survives_the_eviction_of_its_cached_source():
    kv, fake = PoolCacheManager(6 * B, 16, True, 6 * B), FakeKV()
    system = list(range(3 * B))
    first = system + [7]
    finish(kv, fake, run(kv, fake, first), first)
    second = system + [8, 9]
    b = run(kv, fake, second)  # shares the 3 blocks
    kv.clear_cache()
    fake.apply(kv.take_ops())
    assert fake.tokens(b) == second and kv.num_cells_used == fake.num_live_cells() == 3 * B + 2


def test_cached_cells_are_bounded():
    kv, fake = PoolCacheManager(64 * B, 32, True, max_cached_cells=4 * B), FakeKV()
    for i in range(6):
        prompt = [i] * (2 * B)
        finish(kv, fake, run(kv, fake, prompt), prompt)
        assert kv.num_cells_evictable <= 4 * B
    assert kv.num_cached_holders == 2


def test_twins_computing_the_same_tokens_keep_separate_cells_and_the_index_stays_sound():
    kv, fake = PoolCacheManager(1024, 16, True, 1024), FakeKV()
    prompt = list(range(2 * B))
    a = run(kv, fake, prompt)
    b_id, _ = kv.admit(lambda x, y: prompt[x:y], len(prompt))
    fake.apply(kv.take_ops())
    fake.compute(b_id, prompt)
    kv.commit(b_id, lambda x, y: prompt[x:y], len(prompt))
    # Both "generate" the same block: only the first to commit indexes it.
    longer = prompt + list(range(500, 500 + B))
    for seq_id in (a, b_id):
        kv.grow(seq_id, len(longer))
        fake.compute(seq_id, longer)
        kv.commit(seq_id, lambda x, y: longer[x:y], len(longer))
    finish(kv, fake, a, longer)
    finish(kv, fake, b_id, longer)
    c = run(kv, fake, longer + [1])
    assert fake.tokens(c) == longer + [1]
    assert kv.num_cells_used == fake.num_live_cells()


@pytest.mark.parametrize("pin", [False, True])
def test_random_traffic_keeps_the_counts_equal_to_what_llama_cpp_would_hold(pin):
    rng = random.Random(1234)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 5 * B))] for _ in range(4)]
    kv, fake = PoolCacheManager(40 * B, 24, True, 12 * B, pin_indexed_cells=pin), FakeKV()
    running: dict[int, list[int]] = {}
    for _ in range(600):
        if running and (len(running) >= 3 or rng.random() < 0.4):
            seq_id = rng.choice(list(running))
            finish(kv, fake, seq_id, running.pop(seq_id), keep=rng.random() < 0.8)
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 2 * B))]
            placed = kv.admit(lambda a, b: tokens[a:b], len(tokens))
            if placed is None:
                continue
            seq_id, num_reused = placed
            fake.apply(kv.take_ops())
            assert fake.tokens(seq_id) == tokens[:num_reused]
            fake.compute(seq_id, tokens)
            kv.commit(seq_id, lambda a, b: tokens[a:b], len(tokens))
            running[seq_id] = tokens
        fake.apply(kv.take_ops())
        assert kv.num_cells_used == fake.num_live_cells() <= kv.num_cells
        for seq_id, tokens in running.items():
            assert fake.tokens(seq_id) == tokens
        if pin:  # no indexed cell is ever owned by one sequence alone
            owners: dict[int, int] = {}
            for held in fake.cells.values():
                for cell in held:
                    owners[id(cell)] = owners.get(id(cell), 0) + 1
            for holder in kv._holders.values():
                assert all(owners[id(c)] >= 2 for c in fake.cells[holder.seq_id][: holder.num_indexed * B])
    assert kv.num_tokens_reused > 0
