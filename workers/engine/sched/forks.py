"""Sequences with the same prompt (a request's `n` choices, say) compute it once.

The first to be admitted computes the prompt (the parent); each later one with the same
prompt tokens (a fork) copies the parent's KV instead of computing it:
- while the parent still prefills, the fork is admitted with a KV id of its own but
  nothing in it, and waits (FORKING); when the step that computes the parent's last prompt
  token is done, the fork copies the parent's KV and samples its first token from the
  parent's logits row with its own sampler, in that same step. A fork that cannot share
  the row (see `can_share_row`) copies all but the last prompt token and computes that
  one token itself in the next step;
- a fork admitted after that step but before the next decode finds the parent's row still
  in llama.cpp's logits buffer: it copies the whole prompt and samples from that row before
  the decode (the engine does, `Scheduler.take_row_forks`);
- a fork admitted later still copies all but the last prompt token at admission, and
  computes that one token itself.
The row is shared only by sequences whose first sample reads it the same way: both
sampled on the host (a row sampled in llama.cpp's graph is not kept on the host), and
the same end-of-generation masking, which writes into the row.
`is_prefilled_elsewhere` is the scheduler's wait while a running sequence computes a
prefix another would reuse (`num_shared_tokens`: how much of a prompt another sequence's
tokens begin with): the prefix is then computed once, not by both at the same time.
No model here; the scheduler decides, the KV managers copy (`KVManager.fork`).
"""

from cbatch.workers.engine.kv.base import BLOCK_TOKENS, KVManager
from cbatch.workers.engine.sequence import Sequence


def masks_eog_at_first_sample(seq: Sequence) -> bool:
    # greedy_rows and suppress_eog write -inf into the logits row itself
    return seq.params.ignore_eos if seq.sampler is None else seq.params.min_tokens > 0


def can_share_row(parent: Sequence, fork: Sequence) -> bool:
    """May `fork` sample its first token from `parent`'s logits row?"""
    return (not parent.is_backend_sampled and not fork.is_backend_sampled
            and masks_eog_at_first_sample(parent) == masks_eog_at_first_sample(fork))


def can_share_last_row(parent: Sequence, fork: Sequence) -> bool:
    """May `fork` sample its first token from the row `parent` sampled its own first token
    from, in the last decode? Only while that decode's logits last (no decode since: the
    parent has not fed its first token), and only if the row needs no copy from before
    its masking (logprobs of a masked row are the raw row's)."""
    return (parent.num_output_tokens == 1 and parent.num_cached == parent.num_prompt_tokens
            and can_share_row(parent, fork)
            and not (fork.params.logprobs is not None and masks_eog_at_first_sample(fork)))


class PendingForks:
    """The forks waiting for a prefilling parent, in arrival order."""

    def __init__(self):
        self._by_parent: dict[Sequence, list[Sequence]] = {}

    def __len__(self) -> int:
        return sum(len(forks) for forks in self._by_parent.values())

    def add(self, parent: Sequence, fork: Sequence) -> None:
        self._by_parent.setdefault(parent, []).append(fork)

    def of(self, parent: Sequence) -> list[Sequence]:
        return self._by_parent.get(parent, [])

    def take(self, parent: Sequence) -> list[Sequence]:
        """The forks of `parent`, which no longer wait for it."""
        return self._by_parent.pop(parent, [])

    def remove(self, fork: Sequence) -> None:
        for parent, forks in self._by_parent.items():
            if fork in forks:
                forks.remove(fork)
                if not forks:
                    del self._by_parent[parent]
                return


def find_parent(seq: Sequence, running: list[Sequence]) -> Sequence | None:
    """A running sequence with exactly seq's prompt whose KV seq can copy: one still
    prefilling (seq waits for it), or one that computed at least all but its last prompt
    token. A forked sequence is a parent too once its own KV holds the prompt."""
    if seq.num_output_tokens:
        return None  # preempted with output: it recomputes all of it
    num_prompt = seq.num_prompt_tokens
    for other in running:
        if other.num_prompt_tokens == num_prompt and other.prompt_ids == seq.prompt_ids:
            if other.is_prefilling or (num_prompt > 1 and other.num_cached >= num_prompt - 1):
                return other
    return None


def num_shared_tokens(seq: Sequence, other: Sequence) -> int:
    """The whole blocks of seq's tokens (its last token excluded: it is always computed)
    that other's tokens begin with."""
    num_blocks = min(seq.num_tokens - 1, other.num_tokens) // BLOCK_TOKENS
    num_shared = 0
    while num_shared < num_blocks and seq.token_slice(num_shared * BLOCK_TOKENS, (num_shared + 1) * BLOCK_TOKENS) \
            == other.token_slice(num_shared * BLOCK_TOKENS, (num_shared + 1) * BLOCK_TOKENS):
        num_shared += 1
    return num_shared * BLOCK_TOKENS


def is_prefilled_elsewhere(seq: Sequence, running: list[Sequence], kv: KVManager) -> bool:
    """Is a running sequence computing the next block `seq` could reuse right now (one the
    KV manager will really reuse: a stream is copied only for a long enough prefix)?"""
    if not kv.enable_prefix_cache:
        return False
    end = kv.num_reusable(seq.token_slice, seq.num_tokens) + BLOCK_TOKENS
    if end >= seq.num_tokens:
        return False  # that block holds the last token, which seq computes itself
    prefix = seq.token_slice(0, end)
    return any(other.num_cached < end <= other.num_tokens and other.token_slice(0, end) == prefix
               and num_shared_tokens(seq, other) >= kv.min_reuse_tokens for other in running)
