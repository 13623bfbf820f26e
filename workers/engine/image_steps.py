"""Image embeddings written into their sequences' KV, a chunk per step (vision.py made them).

A llama_batch carries token ids or embeddings, never both, so a step that has images to
write makes one more llama_decode, of embeddings only, before its token batch. A prompt
chunk stops where an image starts (Sequence.num_text_ahead), so a text chunk never needs
an image's cells before they are written; the image then takes the room the step's token
batch leaves of --batch-size, shared by the sequences waiting at an image in the order of
text chunks (interactive first, then the fewest tokens left; batch sequences' images within
the batch chunks' share beside interactive work, step_batch.py), and its sequence's next
text chunk comes in a later step. An image's positions
produce no logits: a prompt never ends with one (preparation.py).
"""

import llama_cpp.llama_cpp as lc
import numpy as np

from cbatch.workers.engine.decode_mark import marked_decode
from cbatch.workers.engine.model_runner import ModelRunner
from cbatch.workers.engine.sched.step_batch import BatchSpan, chunk_order, max_batch_chunk_tokens
from cbatch.workers.engine.sequence import SeqStatus


class EmbeddingBatch:
    """A llama_batch of embeddings for up to `max_tokens` positions, one sequence id each."""

    def __init__(self, max_tokens: int, num_embd: int):
        self.batch = lc.llama_batch_init(max_tokens, num_embd, 1)
        self.num_embd = num_embd
        self._embd = np.ctypeslib.as_array(self.batch.embd, shape=(max_tokens, num_embd))
        self._positions = np.ctypeslib.as_array(self.batch.pos, shape=(max_tokens,))
        self._num_seq_ids = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(max_tokens,))
        self._wants_logits = np.ctypeslib.as_array(self.batch.logits, shape=(max_tokens,))

    def fill(self, chunks: list[tuple]) -> None:
        """chunks: (sequence, image, first position, positions) each."""
        n = 0
        for seq, image, start, num_positions in chunks:
            offset = start - image.start
            self._embd[n:n + num_positions] = image.embeddings[offset:offset + num_positions]
            self._positions[n:n + num_positions] = np.arange(start, start + num_positions)
            for i in range(n, n + num_positions):  # ctypes stores: a few hundred per image chunk
                self.batch.seq_id[i][0] = seq.seq_id
            n += num_positions
        self._num_seq_ids[:n] = 1
        self._wants_logits[:n] = 0
        self.batch.n_tokens = n

    def close(self) -> None:
        if self.batch is not None:
            lc.llama_batch_free(self.batch)
            self.batch = None


class ImageWriter:
    def __init__(self, runner: ModelRunner, max_batch_tokens: int):
        self._runner = runner
        self._max_batch_tokens = max_batch_tokens
        self._batch = EmbeddingBatch(max_batch_tokens, runner.vision.num_embd)

    def has_chunks(self, scheduler) -> bool:
        """Whether a running sequence waits at an image."""
        return any(seq.status is SeqStatus.PREFILLING and seq.image_at(seq.num_cached) for seq in scheduler.running)

    def write(self, scheduler, spans: list[BatchSpan]) -> list[tuple]:
        """Write this step's image chunks, in the room `spans` leave; counts them computed.
        Returns (sequence, error message) for each sequence whose chunk failed."""
        room = self._max_batch_tokens - sum(span.num_tokens for span in spans)
        batch_room = min(room, max_batch_chunk_tokens(scheduler.running, self._max_batch_tokens,
                                                      self._max_batch_tokens) - sum(
            span.num_tokens for span in spans if span.seq.is_batch and span.seq.status is SeqStatus.PREFILLING))
        at_images = [seq for seq in scheduler.running
                     if seq.status is SeqStatus.PREFILLING and seq.image_at(seq.num_cached) is not None]
        chunks = []
        for seq in sorted(at_images, key=chunk_order):
            limit = min(room, batch_room) if seq.is_batch else room
            if limit <= 0:
                continue
            image = seq.image_at(seq.num_cached)
            num_positions = min(image.end - seq.num_cached, limit)
            chunks.append((seq, image, seq.num_cached, num_positions))
            room -= num_positions
            batch_room -= num_positions if seq.is_batch else 0
        if not chunks:
            return []
        self._batch.fill(chunks)
        status = marked_decode(self._runner.mark_decoding, [seq.request_id for seq, *_ in chunks], self._runner.ctx,
                               self._batch.batch)
        if status != 0:
            return [(seq, f"llama_decode failed with status {status} writing an image") for seq, *_ in chunks]
        for seq, _, start, num_positions in chunks:
            scheduler.on_computed(BatchSpan(seq, start, num_positions))
        return []

    def close(self) -> None:
        self._batch.close()


def image_writer(runner: ModelRunner, max_batch_tokens: int) -> ImageWriter | None:
    """The engine's writer of image chunks, when the runner has a projector."""
    return ImageWriter(runner, max_batch_tokens) if getattr(runner, "vision", None) is not None else None
