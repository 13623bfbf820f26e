"""What goes into one step's batch: a span of tokens per running sequence, and how the
prompt chunks share the step's token budget (the scheduler decides who runs)."""

from operator import attrgetter

from cbatch.workers.engine.sequence import SeqStatus, Sequence

# Beside running interactive sequences, batch prompt chunks take at most 1/N of a step's
# token budget (prefill_spans).
BATCH_PREFILL_DIVISOR = 4


class BatchSpan:
    """One sequence's run of tokens in this step's batch: `num_tokens` tokens of `seq` from KV
    position `start` (a prompt chunk, or the one decode token of a generating sequence).
    A plain slotted class: a step makes one per running sequence."""

    __slots__ = ("seq", "start", "num_tokens", "wants_logits")

    def __init__(self, seq: Sequence, start: int, num_tokens: int):
        self.seq, self.start, self.num_tokens = seq, start, num_tokens
        # Only a span that reaches the last known token (when it is scheduled) yields a sample.
        self.wants_logits = start + num_tokens == seq.num_tokens

    def __repr__(self) -> str:
        return f"BatchSpan(request {self.seq.request_id}, start {self.start}, {self.num_tokens} tokens)"


def request_ids(spans: list[BatchSpan]) -> list[int]:
    """The request ids of a batch's spans, in order (the decode's crash mark)."""
    return [span.seq.request_id for span in spans]


# The unified pool takes a batch in any order, but with per-sequence streams llama.cpp cuts
# a batch into one micro-batch per run of consecutive seq ids (and equal token counts): in
# id order a step stays one or two micro-batches, in admission order it falls apart once
# reused slots interleave.
span_order = attrgetter("seq.seq_id")


def chunk_order(seq: Sequence) -> tuple[bool, int]:
    """Prompt chunks (text or image) go interactive first, then the fewest tokens left."""
    return seq.is_batch, seq.num_uncached


def max_batch_chunk_tokens(running: list[Sequence], budget: int, max_step_tokens: int) -> int:
    """What batch prompt chunks may take of a step: all of `budget` when only batch work (or
    paused work, which waits on no step) runs, else 1/BATCH_PREFILL_DIVISOR of a step."""
    if all(seq.is_batch or seq.is_paused for seq in running):
        return budget
    return max(1, max_step_tokens // BATCH_PREFILL_DIVISOR)


def prefill_spans(running: list[Sequence], budget: int, max_step_tokens: int) -> list[BatchSpan]:
    """The prompt chunks of `budget` tokens: interactive sequences' first, then batch ones',
    within each priority the fewest tokens left first, then in admission order (`running`'s):
    a conversation's returning turn, most of it cached, finishes its prefill in the step
    that admits it instead of after a long cold prompt's chunk, which loses only those few
    tokens of its step. Beside interactive work the batch chunks take at most
    1/BATCH_PREFILL_DIVISOR of a step of `max_step_tokens`, so that the steps an interactive
    request waits on for its first token stay short (a paused one waits on none)."""
    prefilling = sorted((seq for seq in running if seq.status is SeqStatus.PREFILLING), key=chunk_order)
    max_batch_tokens = max_batch_chunk_tokens(running, budget, max_step_tokens)
    spans = []
    for seq in prefilling:
        room = min(budget, max_batch_tokens) if seq.is_batch else budget
        if room == 0:
            continue  # past the budget or the batch chunks' share: nothing more fits
        num_tokens = min(seq.num_text_ahead(), room)
        if num_tokens == 0:
            continue  # at an image: its embeddings are written beside the batch (the engine's image_steps.py)
        spans.append(BatchSpan(seq, seq.num_cached, num_tokens))
        budget -= num_tokens
        if seq.is_batch:
            max_batch_tokens -= num_tokens
    return spans
