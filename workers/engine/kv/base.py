"""What the scheduler asks of a KV layout, and what both layouts share.

Two layouts implement KVManager: the unified pool (kv/pool.py, `--kv-unified`), where
shared prefixes share cells, and per-sequence streams (kv/streams.py, the default), where
a prefix is reused in place or by copying a whole stream. Both index computed prompt
blocks in a radix tree of BLOCK_TOKENS-token edges, matched by `match_prefix`.

Below both, a host-memory tier (kv/host_tier.py, and a disk tier under it) keeps the
states of prefixes the device tier gives up: a KV manager saves a sequence before it is
trimmed or overwritten, and restores a saved prefix into a new sequence when that reuses
more than the device tier would.

Neither calls llama.cpp: each collects the memory operations llama.cpp must apply before
the next decode (`take_ops`), so both are tested without a model.
"""

from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from cbatch.workers.engine.kv.host_tier import HostTier

BLOCK_TOKENS = 16
OP_COPY = "copy"  # (OP_COPY, src_seq_id, dst_seq_id, start, end): positions [start, end)
OP_REMOVE = "remove"  # (OP_REMOVE, seq_id, start): positions [start, end of the sequence)
# (OP_SAVE, seq_id, SavedPrefix): fill the entry's states from the sequence, which holds
# exactly its tokens; with a checkpoint, the sequence is left trimmed to the checkpoint.
OP_SAVE = "save"
# (OP_RESTORE, seq_id, Restore): the sequence, empty, takes the saved state's first
# num_tokens positions; the runner reports a failed one, which the engine recomputes.
OP_RESTORE = "restore"

TokenSlice = Callable[[int, int], list[int]]  # tokens [start, stop) of a sequence


def match_prefix(root, token_slice: TokenSlice, num_tokens: int) -> list:
    """The index nodes of the longest indexed prefix of a sequence's tokens, one per
    block, from the root's child down. A node's `children` maps a block's token tuple to
    the next node. The block holding the last token is never matched: the sequence must
    compute that token itself to get its logits."""
    path = []
    node = root
    for i in range((num_tokens - 1) // BLOCK_TOKENS):
        node = node.children.get(tuple(token_slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)))
        if node is None:
            break
        path.append(node)
    return path


class KVManager(Protocol):
    num_cells: int
    enable_prefix_cache: bool
    pin_indexed_cells: bool
    num_tokens_reused: int  # prompt tokens served from the cache at admission
    num_lookups: int  # admissions that looked for a cached prefix
    num_device_hits: int  # ... and found one on the device (not restored from the host tier)
    host: "HostTier | None"  # the host-memory tier below the device, or None
    # A running sequence's computed prefix is reused by another admission only when they
    # share at least this many tokens (the pool shares any block; a stream is copied
    # whole, which pays only for longer prefixes).
    min_reuse_tokens: int

    @property
    def num_cells_used(self) -> int: ...

    @property
    def num_cells_evictable(self) -> int:
        """Cells that hold only cached prefixes, which the next admission may take."""

    @property
    def num_cached_holders(self) -> int: ...

    def take_ops(self) -> list[tuple]:
        """The memory operations to apply before the next decode, in order."""

    def num_reusable(self, token_slice: TokenSlice, num_tokens: int) -> int:
        """How many leading tokens an admission now would reuse."""

    def admit(self, token_slice: TokenSlice, num_tokens: int, reuse: bool = True) -> tuple[int, int] | None:
        """(sequence id, tokens reused) for a new sequence, or None when there is no room.
        Without `reuse` nothing cached is reused (a fork: its KV is copied later)."""

    def fork(self, src_seq_id: int, dst_seq_id: int, num_tokens: int) -> None:
        """dst, admitted with nothing reused or computed, takes positions [0, num_tokens)
        of running src (their cells shared where the layout can), and keeps room for the
        tokens it was admitted with."""

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Room for positions [0, num_tokens) of a running sequence; False when none."""

    def commit(self, seq_id: int, token_slice: TokenSlice, num_computed: int) -> None:
        """Positions [0, num_computed) are computed: index the blocks that became full."""

    def release(self, seq_id: int, token_slice: TokenSlice, num_computed: int, keep: bool,
                num_prompt_tokens: int = 0) -> None:
        """The sequence ended; with keep, its computed prefix stays cached. Its prompt's
        end is where a later turn of the same conversation most likely diverges from it."""

    def forget(self, seq_id: int) -> None:
        """A running sequence's restore failed: it holds nothing and recomputes from 0."""

    def spill_all(self) -> None:
        """Save every cached prefix to the host tier (before the daemon stops)."""

    def clear_cache(self) -> None: ...
