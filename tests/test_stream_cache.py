"""Prefix cache over per-sequence KV streams, without a model: what is reused in place,
what is copied as a whole stream, and which stream a request gets."""

from cbatch.workers.engine.kv.base import OP_COPY, OP_REMOVE
from cbatch.workers.engine.kv.streams import WHOLE_STREAM, StreamCacheManager


def slicer(tokens):
    return lambda start, stop: tokens[start:stop]


def run(manager, tokens, num_computed=None):
    """Admit, compute and commit a sequence; returns its (seq_id, reused)."""
    placed = manager.admit(slicer(tokens), len(tokens))
    assert placed is not None
    manager.commit(placed[0], slicer(tokens), len(tokens) if num_computed is None else num_computed)
    return placed


def test_a_finished_prefix_is_reused_in_its_own_stream_and_the_rest_trimmed():
    kv = StreamCacheManager(num_streams=2, cells_per_stream=256, enable_prefix_cache=True)
    first = list(range(1, 41))
    seq_id, reused = run(kv, first)
    assert reused == 0
    kv.release(seq_id, slicer(first), 40, keep=True)
    kv.take_ops()
    second = first[:35] + [99] * 10
    assert kv.admit(slicer(second), len(second)) == (seq_id, 32)  # two whole blocks, in place
    assert kv.take_ops() == [(OP_REMOVE, seq_id, 32)]
    assert kv.num_tokens_reused == 32


def test_a_running_streams_prefix_is_copied_whole_then_trimmed():
    kv = StreamCacheManager(num_streams=3, cells_per_stream=256, enable_prefix_cache=True)
    prompt = list(range(1, 101))
    running_id, _ = run(kv, prompt)
    kv.take_ops()
    other = prompt[:96] + [7, 7, 7]
    seq_id, reused = kv.admit(slicer(other), len(other))
    assert seq_id != running_id and reused == 96
    assert kv.take_ops() == [(OP_COPY, running_id, seq_id, 0, WHOLE_STREAM), (OP_REMOVE, seq_id, 96)]


def test_a_short_match_elsewhere_is_not_worth_a_copy():
    kv = StreamCacheManager(num_streams=3, cells_per_stream=256, enable_prefix_cache=True)
    prompt = list(range(1, 40))
    run(kv, prompt)  # still running: two whole blocks, fewer than a copy's worth
    kv.take_ops()
    seq_id, reused = kv.admit(slicer(prompt[:33] + [5]), 34)
    assert reused == 0 and kv.take_ops() == [(OP_REMOVE, seq_id, 0)]


def test_free_streams_are_given_least_recently_used_first_and_none_when_all_run():
    kv = StreamCacheManager(num_streams=2, cells_per_stream=64, enable_prefix_cache=True)
    a, b = [1] * 20, [2] * 20
    id_a, _ = run(kv, a)
    id_b, _ = run(kv, b)
    assert kv.admit(slicer([3] * 5), 5) is None  # every stream runs
    kv.release(id_a, slicer(a), 20, keep=True)
    kv.release(id_b, slicer(b), 20, keep=True)
    assert kv.num_cached_holders == 2 and kv.num_cells_evictable == 32
    assert kv.admit(slicer([3] * 5), 5)[0] == id_a  # a's was used longest ago
    assert kv.admit(slicer(b + [4]), 21) == (id_b, 16)  # b's prefix survived
    assert kv.admit(slicer([1] * 70), 70) is None  # longer than a stream


def test_without_keep_or_with_the_cache_off_nothing_is_indexed():
    kv = StreamCacheManager(num_streams=1, cells_per_stream=64, enable_prefix_cache=True)
    prompt = [5] * 40
    seq_id, _ = run(kv, prompt)
    kv.release(seq_id, slicer(prompt), 40, keep=False)  # a failed decode
    assert kv.admit(slicer(prompt), 40) == (seq_id, 0)
    off = StreamCacheManager(num_streams=1, cells_per_stream=64, enable_prefix_cache=False)
    seq_id, _ = run(off, prompt)
    off.release(seq_id, slicer(prompt), 40, keep=True)
    assert off.admit(slicer(prompt), 40) == (seq_id, 0) and off.num_cells_used == 40
