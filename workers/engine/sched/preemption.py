"""Which running batch sequences give their slots to waiting interactive requests.

Admission puts every interactive request before any batch one, but a slot frees only when
a running sequence ends: with every slot held by long batch generations an interactive
request would wait for the first of them to finish. Instead, while interactive requests
wait and too few slots are free, the scheduler preempts running batch sequences back to
the head of the batch queue (Scheduler.preempt, the path KV exhaustion takes too), and the
interactive requests are admitted in the same step.

Invariants:
- only a batch sequence gives up its slot, and only to an interactive request:
  interactive work never yields to interactive work, and batch work takes no one's slot
  (a lack of KV cells preempts the newest batch sequence, or the newest when none runs: a path of its own);
- a preempted sequence keeps its output (already streamed) and its sampler, whose state
  (a seeded chain's random state, penalties, a grammar) is not touched: it resumes by
  recomputing prompt + output, from the prefix cache where that still holds them, and
  continues as it would have without the pause, as far as llama.cpp computes that KV the
  same in a prefill chunk as one token at a time (docs/operations.md measures how far);
- it goes back to the batch resume queue, so it is the first batch work admitted once no
  interactive request waits, whichever tenant's batch work arrived since: however often it
  is preempted, it finishes when the interactive load stops.
No model here: the scheduler's tests drive it.
"""

from cbatch.workers.engine.sequence import Sequence


def num_slots_wanted(num_interactive_waiting: int, num_free_slots: int) -> int:
    """Slots that waiting interactive requests lack (0 when the free ones are enough)."""
    return max(0, num_interactive_waiting - num_free_slots)


def choose_batch_victims(running: list[Sequence], num_wanted: int) -> list[Sequence]:
    """Up to `num_wanted` running batch sequences to preempt, those that lose least first.

    What a preempted sequence loses is the work it must redo: the tokens it computed, less
    what the prefix cache still holds when it comes back (the cache may evict it meanwhile,
    and with per-sequence streams the interactive request usually takes its very stream).
    So the fewest computed tokens go first, and among equals the newest admitted (`running`
    is in admission order): the oldest are closest to ending, when they free their slots
    anyway."""
    batch = [seq for seq in reversed(running) if seq.is_batch]  # newest first: sorted() keeps that among equals
    return sorted(batch, key=lambda seq: seq.num_cached)[:num_wanted]
