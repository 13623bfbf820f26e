"""KV accounting and the prefix cache over per-sequence KV streams (--no-kv-unified).

In this layout every sequence id owns a stream of `cells_per_stream` cells, and a token
attends over its own stream only (in the unified pool it attends over the used range of
the whole pool, other sequences' cells masked): long prompts that share nothing run
several times faster. But llama.cpp copies between streams only whole streams, so cells
cannot be shared the way the unified pool (kv/pool.py) shares them. Here instead:
- a running request owns one stream, which holds any sequence (the engine caps a sequence
  at a stream's size): admission needs only a free stream, never eviction or preemption;
- a finished request's computed blocks stay in its stream, cached, until the stream is
  given to another request; free streams are given least recently used first;
- the index is a radix tree over BLOCK_TOKENS-token blocks whose nodes name the streams
  holding that prefix; a new request reuses the longest indexed prefix in place when a
  free stream holds it (trim the rest), or copies the whole stream that holds it (a
  running one, say) and trims the copy, when that saves at least MIN_COPY_BLOCKS blocks;
- with a host tier (kv/host_tier.py), a free stream's prefix is saved there before the
  stream is trimmed or overwritten for another request, and a request whose saved prefix
  is longer than what the streams hold (by MIN_RESTORE_TOKENS) gets it restored into the
  least recently used free stream: there are as many conversations as the tier holds, not
  as streams.

Invariant: a stream's cells hold positions 0, 1, ... in order. llama.cpp fills a stream
from its head, a trim moves the head back to the first freed cell, and no sequence grows
past its stream, so the head never wraps: a sliding-window layer never hands a cell of a
cached prefix to new tokens, and a prefix longer than the window stays whole (with the
full-size window cache the runner asks for).

Like the pool, this only collects the operations llama.cpp must apply (`ops`, see
kv/base.py).
"""

from collections import OrderedDict
from dataclasses import dataclass, field

from cbatch.workers.engine.kv.base import (
    BLOCK_TOKENS,
    OP_COPY,
    OP_REMOVE,
    OP_RESTORE,
    OP_SAVE,
    TokenSlice,
    match_prefix,
)
from cbatch.workers.engine.kv.host_tier import MIN_RESTORE_TOKENS, HostTier, is_worth_saving

MIN_COPY_BLOCKS = 4  # a whole-stream copy is a memcpy of every layer's stream: worth it past 64 tokens
WHOLE_STREAM = -1  # as the end of an OP_COPY: llama.cpp copies whole streams only


@dataclass(eq=False)
class StreamNode:
    parent: "StreamNode | None"
    key: tuple[int, ...]
    stream_ids: set[int] = field(default_factory=set)  # streams whose cells hold this prefix
    children: dict = field(default_factory=dict)


class StreamCacheManager:
    pin_indexed_cells = False  # see the invariant: nothing needs pinning here
    min_reuse_tokens = MIN_COPY_BLOCKS * BLOCK_TOKENS  # a shorter prefix is not worth a whole-stream copy

    def __init__(self, num_streams: int, cells_per_stream: int, enable_prefix_cache: bool,
                 host: HostTier | None = None):
        self.num_cells = num_streams * cells_per_stream
        self.cells_per_stream = cells_per_stream
        self.enable_prefix_cache = enable_prefix_cache
        self.host = host if enable_prefix_cache else None
        self.num_tokens_reused = 0
        self.num_lookups = self.num_device_hits = 0  # admissions that looked for a prefix; those the streams served
        self.ops: list[tuple] = []
        self._checkpoints = [0] * num_streams  # a free stream's last prompt end, in whole blocks (see release)
        # Sliding-window models: a restore brings those layers' cells within the window of
        # its end only, so the stream then serves no prefix shorter than that end (until
        # it is emptied); 0 = any.
        self._floors = [0] * num_streams
        self._free: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_streams))  # LRU first
        self._paths: dict[int, list[StreamNode]] = {s: [] for s in range(num_streams)}
        self._num_held = [0] * num_streams  # cells reserved (running) or cached (free)
        self._root = StreamNode(None, ())

    @property
    def num_cells_used(self) -> int:
        return sum(self._num_held)

    @property
    def num_cells_evictable(self) -> int:
        return sum(self._num_held[s] for s in self._free)

    @property
    def num_cached_holders(self) -> int:
        return sum(1 for s in self._free if self._num_held[s])

    def take_ops(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def num_reusable(self, token_slice: TokenSlice, num_tokens: int) -> int:
        path = self._match(token_slice, num_tokens)
        num_reusable = BLOCK_TOKENS * self._on_device(path)[2]
        if self.host is not None:
            num_reusable = max(num_reusable, self.host.num_usable(token_slice, num_tokens))
        return num_reusable

    def admit(self, token_slice: TokenSlice, num_tokens: int, reuse: bool = True) -> tuple[int, int] | None:
        """A free stream for a sequence of `num_tokens` tokens, holding the longest cached
        prefix it can (with `reuse`). Returns (seq_id, tokens reused), or None when every
        stream runs."""
        if not self._free or num_tokens > self.cells_per_stream:
            return None
        path = self._match(token_slice, num_tokens) if reuse else []
        free_depth, free_id, copy_depth, copy_id = self._on_device(path)
        is_copied = copy_depth - free_depth >= MIN_COPY_BLOCKS
        num_on_device = BLOCK_TOKENS * (copy_depth if is_copied else free_depth)
        restore = self.host.match(token_slice, num_tokens) if self.host is not None and reuse else None
        if restore is not None and restore.num_tokens - num_on_device >= MIN_RESTORE_TOKENS:
            # Its blocks are indexed again as the sequence commits them.
            seq_id, kept_path, num_reused = next(iter(self._free)), [], restore.num_tokens
            self._spill(seq_id, 0)
            self.ops += [(OP_REMOVE, seq_id, 0), (OP_RESTORE, seq_id, restore)]
            self.host.on_restored(restore)
            self._floors[seq_id] = num_reused if self.host.has_swa else 0
        else:
            if is_copied:
                seq_id, kept_path = next(iter(self._free)), path[:copy_depth]
                self._spill(seq_id, 0)
                self.ops.append((OP_COPY, copy_id, seq_id, 0, WHOLE_STREAM))
                self._floors[seq_id] = self._floors[copy_id]
            elif free_id is not None:
                seq_id, kept_path = free_id, path[:free_depth]
                self._spill(seq_id, free_depth)
            else:
                seq_id, kept_path = next(iter(self._free)), []
                self._spill(seq_id, 0)
                self._floors[seq_id] = 0
            num_reused = BLOCK_TOKENS * len(kept_path)
        self.num_lookups += reuse and self.enable_prefix_cache
        self.num_device_hits += bool(kept_path)
        self.ops.append((OP_REMOVE, seq_id, num_reused))
        self._set_path(seq_id, kept_path)
        del self._free[seq_id]
        self._num_held[seq_id] = num_tokens
        self.num_tokens_reused += num_reused
        return seq_id, num_reused

    def fork(self, src_seq_id: int, dst_seq_id: int, num_tokens: int) -> None:
        """dst's stream becomes a copy of src's, trimmed to [0, num_tokens). The copy is
        of the whole stream, whatever num_tokens: a fork pays it for any prompt length."""
        self.ops.append((OP_COPY, src_seq_id, dst_seq_id, 0, WHOLE_STREAM))
        self.ops.append((OP_REMOVE, dst_seq_id, num_tokens))
        self._floors[dst_seq_id] = self._floors[src_seq_id]
        self._set_path(dst_seq_id, self._paths[src_seq_id][: num_tokens // BLOCK_TOKENS])
        self._num_held[dst_seq_id] = max(self._num_held[dst_seq_id], num_tokens)
        self.num_tokens_reused += num_tokens

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        if num_tokens > self.cells_per_stream:
            return False
        self._num_held[seq_id] = max(self._num_held[seq_id], num_tokens)
        return True

    def commit(self, seq_id: int, token_slice: TokenSlice, num_computed: int) -> None:
        """Index the stream's full blocks whose tokens are now computed."""
        if not self.enable_prefix_cache:
            return
        path = self._paths[seq_id]
        while (len(path) + 1) * BLOCK_TOKENS <= num_computed:
            i = len(path)
            parent = path[-1] if path else self._root
            key = tuple(token_slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS))
            node = parent.children.get(key)
            if node is None:
                node = parent.children[key] = StreamNode(parent, key)
            node.stream_ids.add(seq_id)
            path.append(node)

    def release(self, seq_id: int, token_slice: TokenSlice, num_computed: int, keep: bool,
                num_prompt_tokens: int = 0) -> None:
        """A running stream is done. With `keep` (and the cache on) its computed blocks stay
        cached in it, the prompt's end noted as the checkpoint a save keeps; otherwise it
        is emptied."""
        self._checkpoints[seq_id] = num_prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
        if keep and self.enable_prefix_cache:
            self.commit(seq_id, token_slice, num_computed)
        if not keep or not self.enable_prefix_cache or len(self._paths[seq_id]) * BLOCK_TOKENS < self._floors[seq_id]:
            self._set_path(seq_id, [])
            self._floors[seq_id] = 0
        num_kept = len(self._paths[seq_id]) * BLOCK_TOKENS
        self.ops.append((OP_REMOVE, seq_id, num_kept))
        self._num_held[seq_id] = num_kept
        self._free[seq_id] = None  # the most recently used free stream

    def forget(self, seq_id: int) -> None:
        self.ops.append((OP_REMOVE, seq_id, 0))
        self._set_path(seq_id, [])
        self._floors[seq_id] = 0

    def spill_all(self) -> None:
        for seq_id in self._free:
            self._spill(seq_id, 0)

    def _on_device(self, path: list[StreamNode]) -> tuple[int, int | None, int, int | None]:
        """(depth, stream) of the longest prefix on `path` a free stream can keep in place,
        and of the longest any stream's copy can hold. A stream serves a prefix no shorter
        than its floor only (see _floors)."""
        free_depth, free_id, copy_depth, copy_id = 0, None, 0, None
        for depth, node in enumerate(path, 1):
            holders = [s for s in node.stream_ids if self._floors[s] <= depth * BLOCK_TOKENS]
            if holders:
                copy_depth, copy_id = depth, holders[0]
            held_free = [s for s in holders if s in self._free]
            if held_free:
                free_depth, free_id = depth, held_free[0]
        return free_depth, free_id, copy_depth, copy_id

    def _spill(self, seq_id: int, num_kept_blocks: int) -> None:
        """A free stream is about to keep only its first `num_kept_blocks` blocks: save the
        prefix it holds to the host tier first (with its checkpoint when the trim leaves
        that position whole; see OP_SAVE), unless the device loses too little of it for a
        save to be worth it (host_tier.is_worth_saving): what the stream keeps, or another
        stream holds too, is not lost."""
        path = self._paths[seq_id]
        if self.host is None:
            return
        num_elsewhere = max((depth for depth, node in enumerate(path, 1)
                             if any(s != seq_id and self._floors[s] <= depth * BLOCK_TOKENS for s in node.stream_ids)),
                            default=0)
        if not is_worth_saving((len(path) - max(num_kept_blocks, num_elsewhere)) * BLOCK_TOKENS,
                               len(path) * BLOCK_TOKENS):
            return
        checkpoint = self._checkpoints[seq_id]
        if not max(num_kept_blocks * BLOCK_TOKENS, self._floors[seq_id]) <= checkpoint < len(path) * BLOCK_TOKENS:
            checkpoint = 0
        entry = self.host.plan_save([node.key for node in path], checkpoint)
        if entry is not None:
            self.ops.append((OP_SAVE, seq_id, entry))

    def clear_cache(self) -> None:
        """Empty every free stream (running ones are untouched)."""
        for seq_id in self._free:
            self._set_path(seq_id, [])
            self.ops.append((OP_REMOVE, seq_id, 0))
            self._num_held[seq_id] = 0
            self._floors[seq_id] = 0

    def _match(self, token_slice: TokenSlice, num_tokens: int) -> list[StreamNode]:
        return match_prefix(self._root, token_slice, num_tokens) if self.enable_prefix_cache else []

    def _set_path(self, seq_id: int, new_path: list[StreamNode]) -> None:
        """The stream now holds exactly the prefix `new_path` names."""
        old_path = self._paths[seq_id]
        num_common = 0
        while num_common < min(len(old_path), len(new_path)) and old_path[num_common] is new_path[num_common]:
            num_common += 1
        for node in reversed(old_path[num_common:]):
            node.stream_ids.discard(seq_id)
            if not node.stream_ids and not node.children:  # who holds a child holds its parent
                del node.parent.children[node.key]
        for node in new_path[num_common:]:
            node.stream_ids.add(seq_id)
        self._paths[seq_id] = list(new_path)
