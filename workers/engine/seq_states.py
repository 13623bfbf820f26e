"""One sequence's KV state out of llama.cpp and back (llama_state_seq_*_ext), for the host
tier (kv/host_tier.py): OP_SAVE and OP_RESTORE of the KV managers, applied by the runner.

A state is llama.cpp's own byte format, copied whole: for gemma-3-270m about 9 KB a token,
saved at ~10 GB/s and restored at ~8 GB/s here (1,300 tokens: 11.9 MB, 1.2 ms and 1.4 ms).
The flag PARTIAL_ONLY moves only the sliding-window layers' part, which llama.cpp keeps
within the window of the sequence's end: a checkpoint (see host_tier.py) is that part
saved after trimming the sequence to the checkpoint's length.
"""

import ctypes
import mmap

import llama_cpp.llama_cpp as lc

from cbatch.workers.engine.kv.host_tier import state_buffer

WHOLE = 0
PARTIAL_ONLY = lc.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def save_state(ctx, seq_id: int, flags: int) -> mmap.mmap | None:
    size = lc.llama_state_seq_get_size_ext(ctx, seq_id, flags)
    if not size:
        return None
    data = state_buffer(size)
    written = lc.llama_state_seq_get_data_ext(ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq_id, flags)
    return data if written == size else None


def load_state(ctx, seq_id: int, data, flags: int) -> bool:
    size = len(data)
    return lc.llama_state_seq_set_data_ext(ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq_id, flags) > 0


def save_entry(ctx, memory, seq_id: int, entry) -> None:
    """Fill a host tier entry from the sequence, which holds exactly its tokens; with a
    checkpoint the sequence is left trimmed to it. A failed save leaves `entry.state` None."""
    entry.state = save_state(ctx, seq_id, WHOLE)
    if entry.state is not None and entry.checkpoint_tokens:
        lc.llama_memory_seq_rm(memory, seq_id, entry.checkpoint_tokens, -1)
        entry.checkpoint_state = save_state(ctx, seq_id, PARTIAL_ONLY)
        if entry.checkpoint_state is None:
            entry.state = None


def restore_entry(ctx, memory, seq_id: int, restore) -> bool:
    """Write a saved state into an empty sequence, trimmed to `restore.num_tokens` (and the
    checkpoint's sliding-window part over it); False, the sequence left empty, when
    llama.cpp refuses it or it does not end where it should."""
    is_restored = load_state(ctx, seq_id, restore.state, WHOLE)
    if is_restored:
        lc.llama_memory_seq_rm(memory, seq_id, restore.num_tokens, -1)
        if restore.checkpoint_state is not None:
            is_restored = load_state(ctx, seq_id, restore.checkpoint_state, PARTIAL_ONLY)
    if is_restored and lc.llama_memory_seq_pos_max(memory, seq_id) == restore.num_tokens - 1:
        return True
    lc.llama_memory_seq_rm(memory, seq_id, -1, -1)
    return False
