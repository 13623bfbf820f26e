"""The host-memory tier below the KV slots: saved sequence states, found by prompt prefix.

A server nearly always has more live conversations than slots, and each turn of a chat or
an agent loop sends the whole conversation again. When a stream (or a pool's cached
holder) whose prefix the device tier indexes is given to another request, the KV manager
saves that sequence's state here (llama_state_seq_get_data_ext) instead of dropping it; a
request whose prompt extends a saved prefix gets the state restored into its own sequence
id (set_data_ext) and prefills only the rest.

Terms:
- entry (SavedPrefix): tokens [0, n) of a saved state (n a whole number of blocks), the
  state's bytes while it is in memory, and for a model with sliding-window layers a
  checkpoint: those layers' part of the state at an earlier block boundary, the end of the
  prompt that last ran there.
- usable lengths: how many of an entry's tokens a restore keeps. Without sliding-window
  layers, any whole number of blocks (restore, then trim). llama.cpp saves a
  sliding-window layer's cells within the window of the sequence's end only, so there a
  restore keeps all n tokens, or exactly the checkpoint's (restore, trim, then restore the
  checkpoint's part over the trimmed one's).
- the index: a radix tree of BLOCK_TOKENS-token edges, as the device tier's (kv/base.py);
  a node names the entries that pass through it (`entries`) and those usable exactly there
  (`anchors`: their end, or their checkpoint).

Invariants:
- an entry's tokens extend no other entry's: a saved state replaces the entries it extends
  (a turn's state replaces the turn before), and one is not saved when an entry usable at
  its length holds it already;
- after every settle() and prefetch(), the bytes of the states in memory are at most
  max_bytes, least recently used out first;
- an entry is in the index while its state is in memory or on disk (disk_tier.py), with
  its state in memory or being written there.

Threads: the decode loop matches, saves and settles; the preparer threads prefetch from
disk; the disk tier's writer reports what it wrote and removed. One lock guards the index,
the LRU order and the counters. A restore carries the state's bytes themselves, so an
entry evicted between the loop's match and the runner's restore still restores whole.
"""

import itertools
import mmap
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from cbatch.workers.engine.kv.base import BLOCK_TOKENS, TokenSlice

# A restore is worth it from this many tokens more than the device tier reuses in place: it
# copies the whole state (about 9 KB a token for gemma-3-270m: 1.4 ms for 1,300 tokens on a
# CPU, where 32 tokens of prefill take ~40 ms; on a GPU the copy crosses PCIe and prefill is
# fast, so a block or two is about even).
MIN_RESTORE_TOKENS = 2 * BLOCK_TOKENS
# A save copies a sequence's whole state, but what it adds is only the part no slot keeps:
# many requests sharing a long prefix and differing in a short tail (questions on one
# document) would each save a near copy of the prefix for a block or two. So a save needs
# that part to be a restore's worth and at least 1/MIN_SAVED_SHARE of the state.
MIN_SAVED_SHARE = 8


# Anonymous memory, its pages made present by the kernel in one call: measured here, 12 MB
# took 3.9 ms where a bytearray's page faults took 6.3 ms, and freeing it returns it to the
# system at once (RSS follows the states held, whatever malloc would keep).
STATE_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def state_buffer(size: int) -> mmap.mmap:
    """Writable memory of `size` bytes for a saved state (freed with its last reference)."""
    return mmap.mmap(-1, size, flags=STATE_MAP_FLAGS)


def is_worth_saving(num_tokens_lost: int, num_tokens: int) -> bool:
    """Whether to save a state of `num_tokens` tokens of which the device tier is about to
    lose `num_tokens_lost` (the rest stays in a slot)."""
    return num_tokens_lost >= max(MIN_RESTORE_TOKENS, num_tokens / MIN_SAVED_SHARE)


@dataclass(eq=False)
class TierNode:
    parent: "TierNode | None"
    key: tuple[int, ...]
    children: dict = field(default_factory=dict)
    entries: set = field(default_factory=set)  # SavedPrefix passing through (or ending at) this node
    anchors: set = field(default_factory=set)  # SavedPrefix usable at exactly this depth


@dataclass(eq=False)
class SavedPrefix:
    nodes: list[TierNode]  # one per block, from the root's child down
    checkpoint_tokens: int = 0  # sliding-window layers' part also kept at this length; 0 = none
    state: mmap.mmap | None = None  # the whole state (llama.cpp's format, state_buffer), while in memory
    checkpoint_state: mmap.mmap | None = None
    num_bytes: int = 0  # of both states
    disk_name: str = ""  # the disk tier's file, once written
    is_writing: bool = False  # queued for the disk tier
    is_loading: bool = False  # a preparer reads it from disk
    is_from_disk: bool = False  # its state in memory was read back from disk
    last_used: int = 0

    @property
    def num_tokens(self) -> int:
        return BLOCK_TOKENS * len(self.nodes)

    def tokens(self) -> list[int]:
        return [token for node in self.nodes for token in node.key]


@dataclass(frozen=True)
class Restore:
    """What the runner writes into a sequence: `state`, trimmed to `num_tokens`, then
    `checkpoint_state` over its sliding-window part when `num_tokens` is the checkpoint's."""
    num_tokens: int
    state: mmap.mmap
    checkpoint_state: mmap.mmap | None
    num_state_tokens: int  # the whole state's, before the trim
    entry: SavedPrefix


@dataclass
class TierCounts:
    num_saved: int = 0  # states saved into memory
    num_restored: int = 0  # admissions served by a restore
    num_restored_from_disk: int = 0  # ... of a state read back from disk
    num_tokens_restored: int = 0
    num_evicted: int = 0  # states dropped from memory for room (kept on disk where it holds them)
    num_replaced: int = 0  # entries a longer saved state made useless
    num_loaded: int = 0  # states read back from disk
    num_load_failures: int = 0  # disk files skipped when read (truncated, corrupt, foreign)


class HostTier:
    def __init__(self, max_bytes: int, has_swa: bool, disk=None):
        self.max_bytes = max_bytes
        self.has_swa = has_swa  # usable only at an entry's end or checkpoint (see the terms)
        self.disk = disk  # a DiskTier, or None
        self.lock = threading.Lock()
        self.counts = TierCounts()
        self.num_bytes = 0  # of the states in memory
        self._root = TierNode(None, ())
        self._in_memory: OrderedDict[SavedPrefix, None] = OrderedDict()  # least recently used first
        self._pending: list[SavedPrefix] = []  # saves planned, states not yet settled
        self._clock = itertools.count(1)
        self._num_entries = 0
        if disk is not None:
            self._index_disk()

    # --- the decode loop ---

    def match(self, token_slice: TokenSlice, num_tokens: int) -> Restore | None:
        """The longest usable prefix of a prompt whose state is in memory (the last token
        excluded: its logits must be computed), for the KV manager to restore or not."""
        with self.lock:
            found = self._best(token_slice, num_tokens, in_memory_only=True)
            if found is None:
                return None
            depth, entry = found
            num_tokens = BLOCK_TOKENS * depth
            checkpoint = entry.checkpoint_state if num_tokens < entry.num_tokens and self.has_swa else None
            return Restore(num_tokens, entry.state, checkpoint, entry.num_tokens, entry)

    def num_usable(self, token_slice: TokenSlice, num_tokens: int) -> int:
        with self.lock:
            found = self._best(token_slice, num_tokens, in_memory_only=True)
        return BLOCK_TOKENS * found[0] if found else 0

    def on_restored(self, restore: Restore) -> None:
        """The KV manager restores it: its entry is the most recently used."""
        with self.lock:
            self._touch(restore.entry)
            self.counts.num_restored += 1
            self.counts.num_restored_from_disk += restore.entry.is_from_disk
            self.counts.num_tokens_restored += restore.num_tokens

    def plan_save(self, keys: list[tuple[int, ...]], checkpoint_tokens: int) -> SavedPrefix | None:
        """An entry for a sequence about to be trimmed, holding the blocks `keys`, for the
        runner to fill (its `state`) before settle(); None when an entry usable at that
        length holds it already. A checkpoint is kept only for sliding-window models."""
        with self.lock:
            node, nodes = self._root, []
            for key in keys:
                child = node.children.get(key)
                if child is None:
                    child = node.children[key] = TierNode(node, key)
                node = child
                nodes.append(node)
            # Any entry through this node extends these blocks: a sliding-window model's may
            # not serve exactly this length, but keeping both would break the invariant.
            covering = node.entries
            if covering:
                for entry in covering:
                    self._touch(entry)
                self._prune(node)
                return None
            has_checkpoint = self.has_swa and 0 < checkpoint_tokens < BLOCK_TOKENS * len(keys)
            entry = SavedPrefix(nodes, checkpoint_tokens if has_checkpoint else 0)
            self._register(entry)
            self._pending.append(entry)
            return entry

    def settle(self) -> None:
        """After the runner applied the step's memory operations: the saved states count,
        replace the entries they extend, go to the disk tier, and memory is trimmed to
        max_bytes."""
        if not self._pending:
            return
        with self.lock:
            pending, self._pending = self._pending, []
            for entry in pending:
                if entry.state is None:  # the save failed: nothing to keep
                    self._unregister(entry)
                    continue
                entry.num_bytes = len(entry.state) + len(entry.checkpoint_state or b"")
                self._remember(entry)
                self.counts.num_saved += 1
                for node in entry.nodes[:-1]:
                    for replaced in [e for e in node.anchors if e.nodes[-1] is node]:
                        self.counts.num_replaced += 1
                        self._drop(replaced)
                if self.disk is not None:
                    entry.is_writing = True
                    self.disk.write(entry, entry.tokens(), entry.state, entry.checkpoint_state)
            self._trim_memory()

    # --- the preparer threads ---

    def prefetch(self, prompt_ids: list[int]) -> None:
        """Read the prompt's longest usable prefix from disk into memory when only the disk
        tier holds it, so that the decode loop never waits on a file (disk_tier.py)."""
        if self.disk is None:
            return

        def token_slice(start: int, stop: int) -> list[int]:
            return prompt_ids[start:stop]

        with self.lock:
            found = self._best(token_slice, len(prompt_ids), in_memory_only=False)
            if found is None or found[1].state is not None or found[1].is_loading or not found[1].disk_name:
                return
            entry = found[1]
            entry.is_loading = True
            name, tokens = entry.disk_name, entry.tokens()
        states = self.disk.load(name, tokens)
        with self.lock:
            entry.is_loading = False
            if states is None:
                self.counts.num_load_failures += 1
                self._drop(entry)
            elif self._is_registered(entry) and entry.state is None:
                entry.state, entry.checkpoint_state = states
                entry.is_from_disk = True
                entry.num_bytes = len(entry.state) + len(entry.checkpoint_state or b"")
                self.counts.num_loaded += 1
                self._touch(entry)
                self._remember(entry)
                self._trim_memory()

    # --- the disk tier's writer (called with the lock held) ---

    def on_written(self, entry: SavedPrefix, name: str) -> bool:
        """The disk tier wrote `entry`; False when it left the index meanwhile (the disk
        tier then removes the file)."""
        entry.is_writing = False
        if not self._is_registered(entry):
            return False
        entry.disk_name = name
        return True

    def on_write_failed(self, entry: SavedPrefix) -> None:
        entry.is_writing = False
        if entry.state is None and self._is_registered(entry):
            self._unregister(entry)

    def on_disk_removed(self, entry: SavedPrefix) -> None:
        """The disk tier removed `entry`'s file (for room): it stays while in memory."""
        entry.disk_name = ""
        if entry.state is None and not entry.is_writing and self._is_registered(entry):
            self._unregister(entry)

    def _index_disk(self) -> None:
        """The disk tier's files, found at start, enter the index with their states left on
        disk: longest first, so a file another one extends is removed, least recently used
        first in the LRU order."""
        found = self.disk.scan()  # (tokens, checkpoint tokens, file name), least recently used first
        ages = {name: rank - len(found) for rank, (_, _, name) in enumerate(found)}
        for tokens, checkpoint_tokens, name in sorted(found, key=lambda item: -len(item[0])):
            keys = [tuple(tokens[i:i + BLOCK_TOKENS]) for i in range(0, len(tokens), BLOCK_TOKENS)]
            entry = self.plan_save(keys, checkpoint_tokens)
            if entry is None:
                self.disk.remove(name)
                continue
            self._pending.remove(entry)
            entry.disk_name, entry.last_used = name, ages[name]
            self.disk.register(name, entry)
        self.disk.start(self)

    # --- statistics ---

    def snapshot(self) -> dict:
        with self.lock:
            counts = self.counts
            return {"host_cache_bytes": self.num_bytes, "host_cache_max_bytes": self.max_bytes,
                    "host_cache_entries": self._num_entries, "host_cache_in_memory": len(self._in_memory),
                    "host_cache_saved": counts.num_saved,
                    "host_cache_hits": counts.num_restored - counts.num_restored_from_disk,
                    "disk_cache_hits": counts.num_restored_from_disk,
                    "host_cache_tokens_restored": counts.num_tokens_restored,
                    "host_cache_evictions": counts.num_evicted, "host_cache_replaced": counts.num_replaced,
                    "disk_cache_loaded": counts.num_loaded, "disk_cache_load_failures": counts.num_load_failures,
                    **(self.disk.snapshot() if self.disk is not None else {})}

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # --- the index ---

    def _best(self, token_slice: TokenSlice, num_tokens: int, in_memory_only: bool) -> tuple[int, SavedPrefix] | None:
        path, node = [], self._root
        for i in range((num_tokens - 1) // BLOCK_TOKENS):
            node = node.children.get(tuple(token_slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)))
            if node is None:
                break
            path.append(node)
        for depth in range(len(path), 0, -1):
            candidates = path[depth - 1].anchors if self.has_swa else path[depth - 1].entries
            ready = [e for e in candidates if e.state is not None or (not in_memory_only and e.disk_name)]
            if ready:
                return depth, max(ready, key=lambda e: e.last_used)
        return None

    def _touch(self, entry: SavedPrefix) -> None:
        entry.last_used = next(self._clock)
        if entry in self._in_memory:
            self._in_memory.move_to_end(entry)
        if entry.disk_name and self.disk is not None:
            self.disk.touch(entry.disk_name)

    def _remember(self, entry: SavedPrefix) -> None:
        entry.last_used = next(self._clock)
        self._in_memory[entry] = None
        self.num_bytes += entry.num_bytes

    def _forget_state(self, entry: SavedPrefix) -> None:
        if entry in self._in_memory:
            del self._in_memory[entry]
            self.num_bytes -= entry.num_bytes
        entry.state = entry.checkpoint_state = None

    def _trim_memory(self) -> None:
        while self.num_bytes > self.max_bytes and self._in_memory:
            entry = next(iter(self._in_memory))
            self._forget_state(entry)
            self.counts.num_evicted += 1
            if not entry.disk_name and not entry.is_writing:
                self._unregister(entry)

    def _drop(self, entry: SavedPrefix) -> None:
        """Out of memory, off the disk and out of the index."""
        self._forget_state(entry)
        if entry.disk_name and self.disk is not None:
            self.disk.remove(entry.disk_name)
            entry.disk_name = ""
        if self._is_registered(entry):
            self._unregister(entry)

    def _is_registered(self, entry: SavedPrefix) -> bool:
        return entry in entry.nodes[-1].entries

    def _register(self, entry: SavedPrefix) -> None:
        for node in entry.nodes:
            node.entries.add(entry)
        entry.nodes[-1].anchors.add(entry)
        if entry.checkpoint_tokens:
            entry.nodes[entry.checkpoint_tokens // BLOCK_TOKENS - 1].anchors.add(entry)
        self._num_entries += 1

    def _unregister(self, entry: SavedPrefix) -> None:
        for node in entry.nodes:
            node.entries.discard(entry)
            node.anchors.discard(entry)
        self._num_entries -= 1
        self._prune(entry.nodes[-1])

    def _prune(self, node: TierNode) -> None:
        """Nodes no entry passes through leave the tree, from `node` up."""
        while node.parent is not None and not node.entries and not node.children:
            del node.parent.children[node.key]
            node = node.parent
