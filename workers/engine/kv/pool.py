"""KV accounting and the automatic prefix cache over one llama.cpp KV pool.

llama.cpp has no public "cells used" call, so the engine keeps its own count here and
the scheduler admits, evicts and preempts from it before a batch is built.

Terms:
- holder: a KV sequence id and the positions [0, n) it holds. A running request owns one;
  a finished request's holder may stay on as a *cached* holder whose cells serve later
  prompts until they are needed (least recently used first).
- block: BLOCK_TOKENS consecutive positions of a holder, the unit of sharing. A block is
  shared only once it is full and computed: then `llama_memory_seq_cp(src, dst, 0, n)`
  marks its cells as owned by one more sequence too (no copy in a unified pool).
- the index: a radix tree over token ids with BLOCK_TOKENS-token edges; each node names
  one physical block holding those tokens after that prefix.

Invariants:
- a holder's blocks form a chain from position 0 (sharing always copies [0, n));
- a holder indexes its block i only if its block i-1 is the indexed one, so whoever owns
  a node's block owns every ancestor's block too: any owner can be the source of a copy,
  and a block losing its last owner takes only dead descendants' nodes with it;
- `num_cells_used` is the sum of `size` over blocks with an owner, <= `num_cells`;
  `num_cells_evictable` is the part of it owned by cached holders only.

Sliding-window layers: llama.cpp hands a cell that only one sequence owns to new tokens
as soon as it falls out of that sequence's window, even with full-size SWA caches. A
prefix reused from a holder that has moved past it would then miss part of its window.
With `pin_indexed_cells`, every holder has a twin sequence id (its pin) that owns the
holder's indexed cells too, so they are never owned by one sequence alone.

The host tier (kv/host_tier.py), for a model without sliding-window layers only (a state
saved there must hold every cell of its window, which the pool does not keep for cells it
has handed out): a cached holder's prefix is saved before it is evicted, and so is what a
finished holder computed beyond what the index took (another lineage indexed the same
tokens first, as a restored holder's shared system prompt); a request whose saved prefix
is longer than the pool shares by MIN_RESTORE_TOKENS gets it restored into its own cells.

The memory operations llama.cpp must apply, in order, before the next decode collect in
`ops` (see kv/base.py).
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


@dataclass(eq=False)
class Block:
    size: int = 0  # cells filled; BLOCK_TOKENS once full
    owner_ids: set[int] = field(default_factory=set)  # seq ids of the holders that own it
    num_running_owners: int = 0
    node: "Node | None" = None  # set while the index names this block


@dataclass(eq=False)
class Node:
    parent: "Node | None"
    key: tuple[int, ...]
    block: Block | None
    children: dict = field(default_factory=dict)


@dataclass(eq=False)
class Holder:
    seq_id: int
    blocks: list[Block] = field(default_factory=list)
    num_tokens: int = 0  # cells reserved for positions [0, num_tokens)
    num_indexed: int = 0  # leading blocks the index names
    pin_id: int | None = None  # owns the indexed cells too (with pin_indexed_cells)
    can_index: bool = True  # False once another lineage indexed the same tokens first
    is_running: bool = True


class PoolCacheManager:
    """The unified KV layout (--kv-unified): one pool of cells for every sequence, prefixes
    shared block by block; streams.py's StreamCacheManager is the other layout."""

    min_reuse_tokens = BLOCK_TOKENS  # any full block is shared
    def __init__(self, num_cells: int, num_seq_ids: int, enable_prefix_cache: bool, max_cached_cells: int,
                 pin_indexed_cells: bool = False, host: HostTier | None = None):
        self.num_cells = num_cells
        self.pin_indexed_cells = pin_indexed_cells and enable_prefix_cache
        assert host is None or not host.has_swa, "the pool keeps no sliding-window cells out of a window"
        self.host = host if enable_prefix_cache else None
        self.enable_prefix_cache = enable_prefix_cache
        self.max_cached_cells = max_cached_cells
        self.num_cells_used = 0
        self.num_cells_evictable = 0
        self.num_tokens_reused = 0  # prompt tokens served from the cache at admission
        self.num_lookups = self.num_device_hits = 0  # admissions that looked for a prefix; those the pool served
        self.ops: list[tuple] = []
        self._free_seq_ids = list(range(num_seq_ids - 1, -1, -1))  # pop() hands out 0 first
        self._holders: dict[int, Holder] = {}
        self._cached: OrderedDict[int, Holder] = OrderedDict()  # least recently used first
        self._root = Node(None, (), None)

    @property
    def num_cells_free(self) -> int:
        return self.num_cells - self.num_cells_used

    @property
    def num_cached_holders(self) -> int:
        return len(self._cached)

    def take_ops(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def num_reusable(self, token_slice: TokenSlice, num_tokens: int) -> int:
        """Tokens of a prompt the index (or the host tier) holds, in whole blocks, leaving at
        least the last token to compute (its logits give the first sample)."""
        num_reusable = BLOCK_TOKENS * len(self._match(token_slice, num_tokens))
        if self.host is not None:
            num_reusable = max(num_reusable, self.host.num_usable(token_slice, num_tokens))
        return num_reusable

    def admit(self, token_slice: TokenSlice, num_tokens: int, reuse: bool = True) -> tuple[int, int] | None:
        """Give a sequence of `num_tokens` tokens a KV sequence id holding its longest
        cached prefix (with `reuse`), with cells reserved for the rest. Returns (seq_id,
        tokens reused), or None (and changes nothing) when the pool cannot make room even
        by eviction."""
        restore, source, shared = self._best_prefix(token_slice, num_tokens, reuse)
        pinned = sum(b.size for b in shared if b.num_running_owners == 0)
        num_needed = num_tokens - BLOCK_TOKENS * len(shared)
        if num_needed > self.num_cells_free + self.num_cells_evictable - pinned:
            return None
        holder = self._new_holder(source)
        if holder is None:
            return None
        if shared:
            self._share(source, shared, holder)
        is_reserved = self.grow(holder.seq_id, num_tokens)
        assert is_reserved, "room was checked above"
        num_reused = BLOCK_TOKENS * len(shared)
        if restore is not None:
            # The whole state lands before it is trimmed: make room for what exceeds the
            # reservation (a restore llama.cpp still refuses is recomputed, see OP_RESTORE).
            while self.num_cells_free < restore.num_state_tokens - num_tokens and self._cached:
                self._evict(next(iter(self._cached.values())))
            self.ops += [(OP_REMOVE, holder.seq_id, 0), (OP_RESTORE, holder.seq_id, restore)]
            self.host.on_restored(restore)
            num_reused = restore.num_tokens
        self.num_tokens_reused += num_reused
        self.num_lookups += reuse and self.enable_prefix_cache
        self.num_device_hits += bool(shared)
        return holder.seq_id, num_reused

    def _best_prefix(self, token_slice: TokenSlice, num_tokens: int, reuse: bool):
        """(the host tier's saved state to restore or None, the holder whose blocks are
        shared or None, those blocks): a restore worth MIN_RESTORE_TOKENS more than the
        device's cached prefix is taken instead of it, into cells of its own."""
        path = self._match(token_slice, num_tokens) if reuse else []
        restore = self.host.match(token_slice, num_tokens) if self.host is not None and reuse else None
        if restore is not None and restore.num_tokens - BLOCK_TOKENS * len(path) < MIN_RESTORE_TOKENS:
            restore = None
        if restore is not None:  # restored into cells of its own: nothing shared
            path = []
        source = self._owner_of(path[-1].block) if path else None
        return restore, source, source.blocks[: len(path)] if source else []

    def _new_holder(self, source: Holder | None) -> Holder | None:
        """A holder with its sequence ids (two with pinned indexed cells), evicting cached
        prefixes other than source's for them; None when no more can be evicted."""
        num_ids = 2 if self.pin_indexed_cells else 1
        while len(self._free_seq_ids) < num_ids:
            victim = next((h for h in self._cached.values() if h is not source), None)
            if victim is None:
                return None
            self._evict(victim)
        holder = Holder(self._free_seq_ids.pop())
        if self.pin_indexed_cells:
            holder.pin_id = self._free_seq_ids.pop()
        self._holders[holder.seq_id] = holder
        return holder

    def _share(self, source: Holder, shared: list, holder: Holder) -> None:
        """The new holder shares source's first blocks: llama.cpp copies (marks) their cells."""
        if not source.is_running:
            self._cached.move_to_end(source.seq_id)
        for block in shared:
            self._change(block, holder, +1)
        holder.blocks = list(shared)
        holder.num_indexed = len(shared)
        holder.num_tokens = BLOCK_TOKENS * len(shared)
        self.ops.append((OP_COPY, source.seq_id, holder.seq_id, 0, holder.num_tokens))
        if holder.pin_id is not None:
            self.ops.append((OP_COPY, source.seq_id, holder.pin_id, 0, holder.num_tokens))

    def fork(self, src_seq_id: int, dst_seq_id: int, num_tokens: int) -> None:
        """dst (admitted, nothing computed) gives back the cells it reserved and shares
        src's full blocks within [0, num_tokens). The cells of a partial last block are
        shared too in llama.cpp, but counted as dst's own: the count errs on the safe side
        (a block is filled by one holder only), and the cells dst gave back cover them."""
        src, dst = self._holders[src_seq_id], self._holders[dst_seq_id]
        num_reserved = dst.num_tokens
        self._drop_blocks(dst, 0)
        shared = src.blocks[: num_tokens // BLOCK_TOKENS]
        for block in shared:
            self._change(block, dst, +1)
        dst.blocks = list(shared)
        dst.num_tokens = BLOCK_TOKENS * len(shared)
        dst.num_indexed, dst.can_index = min(src.num_indexed, len(shared)), src.can_index
        self.ops.append((OP_COPY, src_seq_id, dst_seq_id, 0, num_tokens))
        if dst.pin_id is not None and dst.num_indexed:
            self.ops.append((OP_COPY, src_seq_id, dst.pin_id, 0, dst.num_indexed * BLOCK_TOKENS))
        is_reserved = self.grow(dst_seq_id, max(num_tokens, num_reserved))
        assert is_reserved, "dst gave back at least as many cells"
        self.num_tokens_reused += num_tokens

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Reserve cells so the holder covers positions [0, num_tokens), evicting cached
        holders if needed. False (nothing reserved) if even that leaves too little room."""
        holder = self._holders[seq_id]
        num_needed = num_tokens - holder.num_tokens
        if num_needed <= 0:
            return True
        while self.num_cells_free < num_needed and self._cached:
            self._evict(next(iter(self._cached.values())))
        if self.num_cells_free < num_needed:
            return False
        while holder.num_tokens < num_tokens:
            if not holder.blocks or holder.blocks[-1].size == BLOCK_TOKENS:
                holder.blocks.append(Block(owner_ids={seq_id}, num_running_owners=1))
            block = holder.blocks[-1]
            added = min(BLOCK_TOKENS - block.size, num_tokens - holder.num_tokens)
            block.size += added
            holder.num_tokens += added
            self.num_cells_used += added
        return True

    def commit(self, seq_id: int, token_slice: TokenSlice, num_computed: int) -> None:
        """Index the holder's full blocks whose tokens are now computed."""
        holder = self._holders[seq_id]
        if not self.enable_prefix_cache:
            return
        first_new = holder.num_indexed
        while holder.can_index and (holder.num_indexed + 1) * BLOCK_TOKENS <= num_computed:
            i = holder.num_indexed
            block = holder.blocks[i]
            parent = holder.blocks[i - 1].node if i else self._root
            key = tuple(token_slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS))
            node = parent.children.get(key)
            if node is None:
                node = parent.children[key] = Node(parent, key, block)
                block.node = node
            elif node.block is not block:
                # The same tokens were computed by another lineage first (two greedy twins,
                # say): this holder's later blocks cannot descend from the indexed ones.
                holder.can_index = False
                break
            holder.num_indexed += 1
        if holder.pin_id is not None and holder.num_indexed > first_new:
            self.ops.append((OP_COPY, seq_id, holder.pin_id, first_new * BLOCK_TOKENS,
                             holder.num_indexed * BLOCK_TOKENS))

    def release(self, seq_id: int, token_slice: TokenSlice, num_computed: int, keep: bool,
                num_prompt_tokens: int = 0) -> None:
        """A running holder is done. With `keep` (and the cache on) its indexed blocks stay
        cached if any of them is not held by another holder already; the rest is freed."""
        holder = self._holders[seq_id]
        if keep and self.enable_prefix_cache:
            self.commit(seq_id, token_slice, num_computed)
            num_blocks = num_computed // BLOCK_TOKENS
            if self.host is not None and is_worth_saving((num_blocks - holder.num_indexed) * BLOCK_TOKENS,
                                                         num_blocks * BLOCK_TOKENS):
                self._save_unindexed(holder, token_slice, num_blocks)
            kept = holder.blocks[: holder.num_indexed]
            if any(len(b.owner_ids) == 1 for b in kept):
                self._drop_blocks(holder, holder.num_indexed)
                for block in kept:
                    self._change(block, holder, 0)
                holder.is_running = False
                self._cached[seq_id] = holder
                while self.num_cells_evictable > self.max_cached_cells and self._cached:
                    self._evict(next(iter(self._cached.values())))
                return
        self._drop_blocks(holder, 0)
        self._free_holder(holder)

    def forget(self, seq_id: int) -> None:
        """Its cells stay reserved: it recomputes into them from position 0."""
        self.ops.append((OP_REMOVE, seq_id, 0))

    def spill_all(self) -> None:
        for holder in self._cached.values():
            self._spill(holder)

    def _spill(self, holder: Holder) -> None:
        """A cached holder (every block indexed) is about to be evicted: save its prefix,
        unless the blocks no other holder owns are too few for a save to be worth it."""
        num_shared = max((i for i, block in enumerate(holder.blocks, 1) if len(block.owner_ids) > 1), default=0)
        if self.host is None or not is_worth_saving((len(holder.blocks) - num_shared) * BLOCK_TOKENS,
                                                    len(holder.blocks) * BLOCK_TOKENS):
            return
        entry = self.host.plan_save([block.node.key for block in holder.blocks], 0)
        if entry is not None:
            self.ops.append((OP_SAVE, holder.seq_id, entry))

    def _save_unindexed(self, holder: Holder, token_slice: TokenSlice, num_blocks: int) -> None:
        """A finished holder computed `num_blocks` whole blocks the index did not take enough
        of (host_tier.is_worth_saving): save them to the host tier before the rest is dropped."""
        keys = [tuple(token_slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)) for i in range(num_blocks)]
        entry = self.host.plan_save(keys, 0)
        if entry is not None:
            self.ops += [(OP_REMOVE, holder.seq_id, num_blocks * BLOCK_TOKENS), (OP_SAVE, holder.seq_id, entry)]

    def clear_cache(self) -> None:
        """Evict every cached holder (running ones are untouched)."""
        while self._cached:
            self._evict(next(iter(self._cached.values())))

    def _match(self, token_slice: TokenSlice, num_tokens: int) -> list[Node]:
        return match_prefix(self._root, token_slice, num_tokens) if self.enable_prefix_cache else []

    def _owner_of(self, block: Block) -> Holder:
        # Any owner holds the whole chain (see the invariants); a running one is preferred
        # so that the copy does not keep a cached holder alive for nothing.
        owners = [self._holders[i] for i in block.owner_ids]
        return next((h for h in owners if h.is_running), owners[0])

    def _evict(self, holder: Holder) -> None:
        self._spill(holder)
        del self._cached[holder.seq_id]
        self._drop_blocks(holder, 0)
        self._free_holder(holder)

    def _free_holder(self, holder: Holder) -> None:
        del self._holders[holder.seq_id]
        self._free_seq_ids.append(holder.seq_id)
        if holder.pin_id is not None:
            self._free_seq_ids.append(holder.pin_id)

    def _drop_blocks(self, holder: Holder, num_kept: int) -> None:
        """Give up the holder's blocks from `num_kept` on (positions after them too)."""
        if holder.num_tokens > num_kept * BLOCK_TOKENS or num_kept == 0:
            self.ops.append((OP_REMOVE, holder.seq_id, num_kept * BLOCK_TOKENS))
        if holder.pin_id is not None and holder.num_indexed > num_kept:
            self.ops.append((OP_REMOVE, holder.pin_id, num_kept * BLOCK_TOKENS))
        for block in holder.blocks[num_kept:]:
            self._change(block, holder, -1)
        del holder.blocks[num_kept:]
        holder.num_tokens = num_kept * BLOCK_TOKENS
        holder.num_indexed = min(holder.num_indexed, num_kept)

    def _change(self, block: Block, holder: Holder, owner_delta: int) -> None:
        """A running `holder` starts owning the block (+1), stops owning it (-1), or stays
        an owner but stops running (0); cell totals and the index follow."""
        was_evictable = bool(block.owner_ids) and block.num_running_owners == 0
        if owner_delta > 0:
            block.owner_ids.add(holder.seq_id)
        elif owner_delta < 0:
            block.owner_ids.discard(holder.seq_id)
        if holder.is_running:
            block.num_running_owners += 1 if owner_delta > 0 else -1
        is_evictable = bool(block.owner_ids) and block.num_running_owners == 0
        self.num_cells_evictable += block.size * (is_evictable - was_evictable)
        if not block.owner_ids:
            self.num_cells_used -= block.size
            if block.node is not None:
                del block.node.parent.children[block.node.key]
                block.node = None
