"""Embeddings from the served model: a second llama.cpp context on the same weights.

    prepare(WorkerEmbed) -> EmbedJob (tokens; off the loop thread) -> add() -> step(): one
    llama_decode over the waiting jobs' inputs -> WorkerEmbedded replies, vectors in input order

The context (embeddings on, the pooling below) is made by the first job that reaches
step(), so a deployment that only generates pays nothing for it. One step decodes the
inputs waiting, several callers' together, up to the batch's tokens (--batch-size) and
sequences; the decode loop runs at most one step between two generation steps, so an
embedding load delays each generation step by at most one such decode (docs/design.md),
and while sequences generate a decode carries no more tokens than the generation step
before it (MIN_EMBED_TOKENS_BESIDE_STEPS at least), so the delay is about one step.
Every input is one sequence, whole in one decode (llama.cpp pools over a sequence within
one micro-batch; an encoder's attention sees all of it at once), so an input holds at
most --batch-size tokens, and no more than the model's training context. The context's
memory is cleared after each decode: no input sees another's.

Pooling: the one the GGUF declares ({arch}.pooling_type: BERT-family models do), else
EngineConfig.pooling (mean by default: a causal LM declares none). Vectors are
L2-normalized, as OpenAI's are.
"""

from dataclasses import dataclass, field

import llama_cpp.llama_cpp as lc
import numpy as np

from cbatch.config import EngineConfig
from cbatch.embeddings import MAX_INPUTS_PER_MESSAGE, vector_bytes
from cbatch.errors import CbatchError, DECODE_FAILED, INVALID_CONFIG, INVALID_REQUEST, PROMPT_TOO_LONG
from cbatch.ipc.worker_messages import WorkerEmbed, WorkerEmbedded
from cbatch.protocol import MAX_FRAME_BYTES
from cbatch.workers.engine.decode_mark import marked_decode, no_mark
from cbatch.workers.engine.runner import BatchBuffer, LlamaRunner

POOLING_TYPES = {"mean": lc.LLAMA_POOLING_TYPE_MEAN, "cls": lc.LLAMA_POOLING_TYPE_CLS,
                 "last": lc.LLAMA_POOLING_TYPE_LAST}
POOLING_NAMES = {value: name for name, value in POOLING_TYPES.items()}
MAX_SEQS_PER_DECODE = 64  # inputs in one llama_decode: each is a sequence id of the context
# Tokens an embedding decode may carry beside running generations even after a small step:
# about a decode step's cost on a GPU, a few ms of the tiny model on a CPU.
MIN_EMBED_TOKENS_BESIDE_STEPS = 64


@dataclass
class EmbedJob:
    embed_id: int
    token_lists: list[list[int]]
    vectors: list[bytes] = field(default_factory=list)  # of the inputs decoded so far, in order

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.token_lists)


class Embedder:
    def __init__(self, runner: LlamaRunner, config: EngineConfig):
        self._runner, self._config = runner, config
        declared = runner.metadata(f"{runner.architecture}.pooling_type")
        declared_type = int(declared) if declared and declared.isdigit() else None
        self.pooling = POOLING_NAMES.get(declared_type, config.pooling)
        self.num_dims = lc.llama_model_n_embd_out(runner.model)
        self.max_input_tokens = min(config.batch_size, lc.llama_model_n_ctx_train(runner.model))
        self._jobs: list[EmbedJob] = []
        self._ctx = None
        self._batch: BatchBuffer | None = None
        self.num_decodes = 0
        self.num_inputs = 0  # embedded, over all decodes
        self.mark_decoding = no_mark  # the decode worker's crash mark (ring.marker), told around llama_decode

    @property
    def has_work(self) -> bool:
        return bool(self._jobs)

    def prepare(self, message: WorkerEmbed) -> EmbedJob:
        """Tokenize and check one request: safe off the loop thread (it reads only the
        model). Raises CbatchError naming the input at fault."""
        if message.dimensions and message.dimensions != self.num_dims:
            raise CbatchError(INVALID_REQUEST, f"dimensions {message.dimensions} cannot be given: this model's "
                                               f"embeddings have {self.num_dims} dimensions (omit dimensions)")
        # The reply carries every vector in one message, within the protocol's frame limit.
        max_inputs = min(MAX_INPUTS_PER_MESSAGE, MAX_FRAME_BYTES // 2 // (4 * self.num_dims))
        if len(message.inputs) > max_inputs:
            raise CbatchError(INVALID_REQUEST, f"at most {max_inputs} inputs per message for this model's "
                                               f"{self.num_dims}-dimension vectors")
        token_lists = []
        for i, item in enumerate(message.inputs):
            tokens = self._runner.tokenize(item) if isinstance(item, str) else item
            if not tokens:
                raise CbatchError(INVALID_REQUEST, f"input[{i}] has no tokens")
            if len(tokens) > self.max_input_tokens:
                raise CbatchError(PROMPT_TOO_LONG, f"input[{i}] is {len(tokens)} tokens; an embedding input "
                                                   f"holds at most {self.max_input_tokens} (the model's training "
                                                   "context, and --batch-size)")
            if max(tokens) >= self._runner.n_vocab:
                raise CbatchError(INVALID_REQUEST, f"input[{i}] has a token id past the vocabulary "
                                                   f"({self._runner.n_vocab} tokens)")
            token_lists.append(list(tokens))
        return EmbedJob(message.embed_id, token_lists)

    def add(self, job: EmbedJob) -> None:
        self._jobs.append(job)

    def step(self, max_tokens: int) -> list[WorkerEmbedded]:
        """Decode the next inputs waiting (from the oldest job on), as many as one decode
        takes and up to `max_tokens` (the first input whatever its length); returns the
        replies of the jobs this completed (or failed)."""
        if self._ctx is None:
            try:
                self._open()
            except CbatchError as err:
                failed, self._jobs = self._jobs, []
                return [WorkerEmbedded(job.embed_id, code=err.code, message=err.message) for job in failed]
        placed = self._place(min(max_tokens, self._config.batch_size))
        status = self._decode(placed)
        replies, jobs_in_batch = [], {id(job): job for job, _ in placed}
        if status != 0:
            self._jobs = [job for job in self._jobs if id(job) not in jobs_in_batch]
            return [WorkerEmbedded(job.embed_id, code=DECODE_FAILED, message=f"llama_decode failed with status "
                                                                             f"{status} on embeddings")
                    for job in jobs_in_batch.values()]
        for seq_id, (job, _) in enumerate(placed):
            pooled = lc.llama_get_embeddings_seq(self._ctx, seq_id)
            vector = np.ctypeslib.as_array(pooled, shape=(self.num_dims,)).astype(np.float32)
            job.vectors.append(vector_bytes(vector / max(float(np.linalg.norm(vector)), 1e-12)))
        for job in jobs_in_batch.values():
            if len(job.vectors) == len(job.token_lists):
                self._jobs.remove(job)
                replies.append(WorkerEmbedded(job.embed_id, job.vectors, job.num_tokens))
        return replies

    def _place(self, max_tokens: int) -> list[tuple[EmbedJob, list[int]]]:
        """The inputs of the next decode, in arrival order: (job, tokens) per sequence."""
        placed, num_tokens = [], 0
        for job in self._jobs:
            for tokens in job.token_lists[len(job.vectors):]:
                if placed and (len(placed) == MAX_SEQS_PER_DECODE or num_tokens + len(tokens) > max_tokens):
                    return placed
                placed.append((job, tokens))
                num_tokens += len(tokens)
        return placed

    def _decode(self, placed: list[tuple[EmbedJob, list[int]]]) -> int:
        tokens, positions, seq_ids = [], [], []
        for seq_id, (_, input_tokens) in enumerate(placed):
            tokens += input_tokens
            positions += range(len(input_tokens))
            seq_ids += [seq_id] * len(input_tokens)
        batch, n = self._batch, len(tokens)
        batch.tokens[:n], batch.positions[:n], batch.seq_ids[:n] = tokens, positions, seq_ids
        batch.wants_logits[:n] = 1  # pooling reads every token's output
        batch.batch.n_tokens = n
        status = marked_decode(self.mark_decoding, self._ctx, batch.batch)
        self.num_decodes += 1
        self.num_inputs += len(placed)
        memory = lc.llama_get_memory(self._ctx)
        if memory:  # a causal model's KV (an encoder keeps none): the next decode starts clean
            lc.llama_memory_clear(memory, False)
        return status

    def _open(self) -> None:
        params = lc.llama_context_default_params()
        params.embeddings = True
        params.pooling_type = POOLING_TYPES[self.pooling]
        params.n_ctx = params.n_batch = params.n_ubatch = self._config.batch_size  # one decode = one micro-batch
        params.n_seq_max = MAX_SEQS_PER_DECODE
        params.kv_unified = True  # one pool for the batch's sequences: each holds only its own input
        params.n_threads = params.n_threads_batch = self._config.num_threads
        params.no_perf = True
        self._ctx = lc.llama_init_from_model(self._runner.model, params)
        if not self._ctx:
            raise CbatchError(INVALID_CONFIG, f"llama.cpp could not create an embedding context of "
                                              f"{self._config.batch_size} tokens; lower --batch-size")
        self._batch = BatchBuffer(self._config.batch_size)

    def snapshot(self) -> dict:
        """For the daemon's stats: inputs per decode shows how well callers were batched."""
        return {"num_embedding_decodes": self.num_decodes, "num_embedding_inputs": self.num_inputs,
                "embedding_pooling": self.pooling}

    def close(self) -> None:
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
