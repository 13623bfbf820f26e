"""Embeddings from the served model: a second llama.cpp context on the same weights.

    prepare(WorkerEmbed) -> EmbedJob (tokens; off the loop thread) -> add() -> step(): one
    llama_decode over the waiting jobs' inputs -> WorkerEmbedded replies, vectors in input order

The context (embeddings on) is made by the first job that reaches step(), so a deployment
that only generates pays nothing for it. One step decodes the inputs waiting, several
callers' together, up to the step's token budget and MAX_SEQS_PER_DECODE sequences; the
decode loop runs at most one step between two generation steps. Beside generation the
budget is a time, about one generation step's (run_engine_loop): the step takes as many
tokens as the embedder's own measured seconds per token fit in it. An embedding token costs
far more than a generated one on a model with a large vocabulary (llama.cpp computes every
input token's logits row when embeddings are on: gemma-3-270m's 262k-wide rows make one
token about 7 ms on 2 cores), so a token count taken from the generation step would stall
the streams for seconds.

A causal LM (no pooling declared in its GGUF) is pooled here, not by llama.cpp: its context
keeps one row per token (pooling NONE), and an input longer than PIECE_TOKENS is split
across steps, its KV kept between them, its rows summed (mean) or the first or last one
kept (cls, last), so a long input never makes one long decode. Where an input is split does
not depend on timing: always at multiples of PIECE_TOKENS, one piece of it per decode, so
the same input gets the same decodes and the same vector, bit for bit, however busy the
host is; the budget only says how many inputs' pieces share a decode, and a decode holds
at least one whole piece (a busy host never shrinks it to a token or two, each paying a
whole decode's fixed cost). An encoder (BERT-family: it declares its pooling)
sees its whole input at once, so each input is whole in one decode, pooled by llama.cpp;
it holds at most --batch-size tokens, and no more than the model's training context.
Memory of finished inputs is removed after each decode: no input sees another's.

Pooling: the one the GGUF declares ({arch}.pooling_type: BERT-family models do), else
EngineConfig.pooling (mean by default: a causal LM declares none). Vectors are
L2-normalized, as OpenAI's are. A job whose caller has gone is cancelled (cancel()):
none of its inputs is decoded after that.
"""

import time
from dataclasses import dataclass, field

import llama_cpp.llama_cpp as lc
import numpy as np

from cbatch.config import EngineConfig
from cbatch.embeddings import MAX_INPUTS_PER_MESSAGE, vector_bytes
from cbatch.errors import DECODE_FAILED, INVALID_CONFIG, INVALID_REQUEST, PROMPT_TOO_LONG, CbatchError
from cbatch.protocol import MAX_FRAME_BYTES
from cbatch.workers.engine.decode_mark import marked_decode, no_mark
from cbatch.workers.engine.runner import BatchBuffer, LlamaRunner
from cbatch.workers.messages import WorkerEmbed, WorkerEmbedded

POOLING_TYPES = {"mean": lc.LLAMA_POOLING_TYPE_MEAN, "cls": lc.LLAMA_POOLING_TYPE_CLS,
                 "last": lc.LLAMA_POOLING_TYPE_LAST}
POOLING_NAMES = {value: name for name, value in POOLING_TYPES.items()}
MAX_SEQS_PER_DECODE = 64  # inputs in one llama_decode: each is a sequence id of the context
# A split input's piece per decode: small enough that a decode of it beside generation stays
# near a step's time on a CPU with a large vocabulary (gemma-3-270m: ~7 ms a token on 2
# cores), large enough to cost near a batched token each.
PIECE_TOKENS = 32
FIRST_STEP_TOKENS = 8  # the first step beside generation, before any embedding token was timed
TOKEN_TIME_SMOOTHING = 0.3  # weight of the latest decode in the seconds-per-token estimate
MIN_TOKEN_SHARE = 0.25  # of a decode's time, counted as its tokens' own whatever the budget


@dataclass
class EmbedJob:
    embed_id: int
    token_lists: list[list[int]]
    vectors: list[bytes] = field(default_factory=list)  # of the inputs finished so far, in order
    # The input being embedded in pieces (the first unfinished one): its tokens decoded so
    # far, and its rows pooled so far (their sum, or the row kept).
    num_done_tokens: int = 0
    pooled: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.token_lists)


@dataclass
class Piece:
    """Tokens [start, end) of one input of a job, in one decode, as sequence seq_id."""
    job: EmbedJob
    tokens: list[int]
    start: int
    end: int
    seq_id: int

    @property
    def is_last(self) -> bool:
        return self.end == len(self.tokens)


class Embedder:
    def __init__(self, runner: LlamaRunner, config: EngineConfig):
        self._runner, self._config = runner, config
        declared = runner.metadata(f"{runner.architecture}.pooling_type")
        declared_type = int(declared) if declared and declared.isdigit() else None
        self.pooling = POOLING_NAMES.get(declared_type, config.pooling)
        self.is_split = declared_type is None  # a causal LM: inputs may span decodes, pooled here
        self.num_dims = lc.llama_model_n_embd_out(runner.model)
        self.max_input_tokens = min(config.batch_size, lc.llama_model_n_ctx_train(runner.model))
        self.piece_tokens = min(PIECE_TOKENS, config.batch_size)  # a decode holds at most --batch-size
        self._jobs: list[EmbedJob] = []
        self._open: Piece | None = None  # the input a decode ended inside of: its KV is kept for the next
        self._ctx = None
        self._batch: BatchBuffer | None = None
        self.s_per_token: float | None = None  # measured over the recent decodes
        self.num_decodes = 0
        self.num_inputs = 0  # embedded, over all decodes
        self.num_tokens = 0  # decoded, over all decodes (cancelled jobs' too)
        self.mark_decoding = no_mark  # the decode worker's crash mark (ring.decode_marker), told around llama_decode

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

    def cancel(self, embed_id: int) -> int | None:
        """Drop a job whose caller has gone: none of its inputs is decoded from now on.
        Returns the tokens decoded for it (what its tenant is charged), or None if no such
        job waits (finished, or not prepared yet)."""
        job = next((job for job in self._jobs if job.embed_id == embed_id), None)
        if job is None:
            return None
        self._jobs.remove(job)
        if self._open is not None and self._open.job is job:
            lc.llama_memory_seq_rm(lc.llama_get_memory(self._ctx), self._open.seq_id, -1, -1)
            self._open = None
        return sum(len(tokens) for tokens in job.token_lists[:len(job.vectors)]) + job.num_done_tokens

    def max_step_tokens(self, budget_s: float) -> int:
        """The tokens of the next step: a time budget's worth at the measured rate."""
        if self.s_per_token is None:
            return FIRST_STEP_TOKENS
        return max(1, min(self._config.batch_size, int(budget_s / self.s_per_token)))

    def step(self, budget_s: float, fixed_s: float = 0.0) -> list[WorkerEmbedded]:
        """Decode the next inputs waiting (from the oldest job on), as many tokens as fit in
        `budget_s` beyond a decode's fixed cost (`fixed_s`: about a generation step's, the
        pass over the weights); returns the replies of the jobs this completed (or failed)."""
        if self._ctx is None:
            try:
                self._open_context()
            except CbatchError as err:
                failed, self._jobs = self._jobs, []
                return [WorkerEmbedded(job.embed_id, code=err.code, message=err.message) for job in failed]
        pieces = self._place(self.max_step_tokens(budget_s))
        started_s = time.perf_counter()
        status = self._decode(pieces)
        num_tokens = sum(piece.end - piece.start for piece in pieces)
        self.num_tokens += num_tokens
        # A token's own cost, less the decode's fixed one, so that a small decode does not
        # look dear per token.
        decode_s = time.perf_counter() - started_s
        measured = max(decode_s - fixed_s, MIN_TOKEN_SHARE * decode_s) / num_tokens
        self.s_per_token = measured if self.s_per_token is None else \
            self.s_per_token + TOKEN_TIME_SMOOTHING * (measured - self.s_per_token)
        jobs_in_batch = list({id(piece.job): piece.job for piece in pieces}.values())
        if status != 0:
            self._jobs = [job for job in self._jobs if job not in jobs_in_batch]
            self._open = None
            lc.llama_memory_clear(lc.llama_get_memory(self._ctx), False)
            return [WorkerEmbedded(job.embed_id, code=DECODE_FAILED, message=f"llama_decode failed with status "
                                                                             f"{status} on embeddings")
                    for job in jobs_in_batch]
        self._pool(pieces)
        replies = []
        for job in jobs_in_batch:
            if len(job.vectors) == len(job.token_lists):
                self._jobs.remove(job)
                replies.append(WorkerEmbedded(job.embed_id, job.vectors, job.num_tokens))
        return replies

    def _place(self, max_tokens: int) -> list[Piece]:
        """The next decode's pieces, in arrival order, within max_tokens but at least one
        (an encoder's input whole, a causal LM's next PIECE_TOKENS of one); a causal LM's
        last piece may end inside its input, whose next piece then opens the next decode."""
        pieces, num_tokens = [], 0
        free_seq_ids = iter(i for i in range(MAX_SEQS_PER_DECODE)
                            if self._open is None or i != self._open.seq_id)
        for job in self._jobs:
            for index in range(len(job.vectors), len(job.token_lists)):
                tokens = job.token_lists[index]
                is_open = self._open is not None and self._open.job is job and index == len(job.vectors)
                start = job.num_done_tokens if is_open else 0
                end = min(len(tokens), start + self.piece_tokens) if self.is_split else len(tokens)
                if pieces and (num_tokens + end - start > max_tokens or len(pieces) == MAX_SEQS_PER_DECODE):
                    return pieces
                pieces.append(Piece(job, tokens, start, end, self._open.seq_id if is_open else next(free_seq_ids)))
                num_tokens += end - start
                if end < len(tokens):
                    return pieces
        return pieces

    def _decode(self, pieces: list[Piece]) -> int:
        batch, n = self._batch, 0
        for piece in pieces:
            num = piece.end - piece.start
            batch.tokens[n:n + num] = piece.tokens[piece.start:piece.end]
            batch.positions[n:n + num] = range(piece.start, piece.end)
            batch.seq_ids[n:n + num] = [piece.seq_id] * num
            n += num
        batch.wants_logits[:n] = 1  # pooling reads every token's output
        batch.batch.n_tokens = n
        status = marked_decode(self.mark_decoding, [piece.job.embed_id for piece in pieces], self._ctx, batch.batch)
        self.num_decodes += 1
        return status

    def _pool(self, pieces: list[Piece]) -> None:
        """Each piece's rows into its job's pool, the finished inputs' vectors appended in
        order, and the memory of every finished input removed (the open one's kept)."""
        rows = (np.ctypeslib.as_array(lc.llama_get_embeddings(self._ctx),
                                      shape=(sum(p.end - p.start for p in pieces), self.num_dims))
                if self.is_split else None)
        offset, self._open = 0, None
        for piece in pieces:
            job = piece.job
            if self.is_split:
                part = rows[offset:offset + piece.end - piece.start]
                offset += piece.end - piece.start
                job.pooled = pooled_rows(self.pooling, job.pooled, part, piece.start == 0)
                job.num_done_tokens = piece.end
                if not piece.is_last:
                    self._open = piece
                    continue
                vector = job.pooled / len(piece.tokens) if self.pooling == "mean" else job.pooled
                job.pooled, job.num_done_tokens = None, 0
            else:
                pooled = lc.llama_get_embeddings_seq(self._ctx, piece.seq_id)
                vector = np.ctypeslib.as_array(pooled, shape=(self.num_dims,))
            vector = vector.astype(np.float32)
            job.vectors.append(vector_bytes(vector / max(float(np.linalg.norm(vector)), 1e-12)))
            self.num_inputs += 1
        memory = lc.llama_get_memory(self._ctx)
        if memory and self._open is None:  # a causal model's KV (an encoder keeps none)
            lc.llama_memory_clear(memory, False)
        elif memory:
            for piece in pieces:
                if piece is not self._open:
                    lc.llama_memory_seq_rm(memory, piece.seq_id, -1, -1)

    def _open_context(self) -> None:
        params = lc.llama_context_default_params()
        params.embeddings = True
        # A causal LM's rows come out one per token and are pooled here (_pool); its context
        # holds an open input's KV beside a whole decode's.
        params.pooling_type = lc.LLAMA_POOLING_TYPE_NONE if self.is_split else POOLING_TYPES[self.pooling]
        params.n_ctx = self._config.batch_size * (2 if self.is_split else 1)
        params.n_batch = params.n_ubatch = self._config.batch_size  # one decode = one micro-batch
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
                "num_embedding_tokens": self.num_tokens,
                "embedding_pooling": self.pooling}

    def close(self) -> None:
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None


def pooled_rows(pooling: str, pooled: np.ndarray | None, rows: np.ndarray, is_first: bool) -> np.ndarray:
    """An input's pool after one more piece of its rows: the running sum (mean), the first
    row (cls) or the latest row (last)."""
    if pooling == "mean":
        total = rows.sum(axis=0, dtype=np.float64)
        return total if is_first else pooled + total
    if pooling == "cls":
        return rows[0].copy() if is_first else pooled
    return rows[-1].copy()
