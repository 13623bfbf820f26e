"""The engine's llama.cpp model and context: loading, tokenizer, batch, decode and logits.
The samplers (workers/engine/sampling/), the embedder and chat_template call llama.cpp too,
on the model and context this module owns.

Uses llama-cpp-python's low-level ctypes bindings (not its high-level `Llama`, which
owns a single sequence). ctypes releases the GIL inside every call, so other Python
threads of the worker (socket I/O) run while llama_decode computes.
"""

import ctypes
import hashlib
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import llama_cpp
import llama_cpp.llama_cpp as lc
import numpy as np

from cbatch.chat_messages import ChatMessage, ToolSpec, has_tool_turns, template_input
from cbatch.config import EngineConfig
from cbatch.errors import INVALID_CONFIG, INVALID_REQUEST, CbatchError
from cbatch.workers.engine.chat_template import model_template
from cbatch.workers.engine.decode_mark import marked_decode, no_mark
from cbatch.workers.engine.kv.base import OP_COPY, OP_REMOVE, OP_RESTORE, OP_SAVE
from cbatch.workers.engine.sampling.backend import BackendSamplers
from cbatch.workers.engine.sched.step_batch import BatchSpan, request_ids
from cbatch.workers.engine.seq_states import restore_entry, save_entry
from cbatch.workers.engine.vision import load_vision

MAX_PIECE_BYTES = 256
FINGERPRINT_SAMPLE_BYTES = 4 << 20  # of the model file's head, and of its tail
ALL_LAYERS = 1 << 30  # as n_gpu_layers: more than any model has


GGML_LOG_LEVEL_ERROR = 4


@lc.llama_log_callback
def _quiet_log(level, text, user_data):
    # llama.cpp logs every load and context detail to stderr; the worker reports what
    # matters itself, but an error (a backend's, say, before an abort) is kept.
    if level == GGML_LOG_LEVEL_ERROR:
        sys.stderr.write(text.decode(errors="replace"))


class BatchBuffer:
    """A llama_batch whose arrays are numpy buffers we own, filled by slice assignment
    instead of per-token ctypes stores. Each token carries exactly one sequence id:
    seq_id[i] points at seq_ids[i]."""

    def __init__(self, max_tokens: int):
        self.tokens = np.zeros(max_tokens, np.int32)
        self.positions = np.zeros(max_tokens, np.int32)
        self.num_seq_ids = np.ones(max_tokens, np.int32)
        self.seq_ids = np.zeros(max_tokens, np.int32)
        self.wants_logits = np.zeros(max_tokens, np.int8)
        int32_p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq_ids.ctypes.data
        self._seq_id_ptrs = (int32_p * max_tokens)(*(ctypes.cast(base + 4 * i, int32_p) for i in range(max_tokens)))
        self.batch = lc.llama_batch()
        self.batch.token = self.tokens.ctypes.data_as(int32_p)
        self.batch.embd = None
        self.batch.pos = self.positions.ctypes.data_as(int32_p)
        self.batch.n_seq_id = self.num_seq_ids.ctypes.data_as(int32_p)
        self.batch.seq_id = self._seq_id_ptrs
        self.batch.logits = self.wants_logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, spans: list[BatchSpan]) -> None:
        # Built as Python lists and stored with one assignment per array: a step of 64
        # one-token decode chunks would otherwise cost 64 x 5 small numpy stores.
        tokens, positions, seq_ids, wants_logits = [], [], [], []
        for span in spans:
            start, num_tokens = span.start, span.num_tokens
            tokens += span.seq.token_slice(start, start + num_tokens)
            positions += range(start, start + num_tokens)
            seq_ids += [span.seq.seq_id] * num_tokens
            wants_logits += [0] * (num_tokens - 1)
            wants_logits.append(span.wants_logits)
        n = len(tokens)
        self.tokens[:n] = tokens
        self.positions[:n] = positions
        self.seq_ids[:n] = seq_ids
        self.wants_logits[:n] = wants_logits
        self.batch.n_tokens = n


def load_model(model_path: str, n_gpu_layers: int):
    """(llama.cpp's model, the layers offloaded); n_gpu_layers < 0 offloads them all."""
    model_params = lc.llama_model_default_params()
    model_params.n_gpu_layers = n_gpu_layers if n_gpu_layers >= 0 else ALL_LAYERS
    model = lc.llama_model_load_from_file(model_path.encode(), model_params)
    if not model:
        raise CbatchError(INVALID_CONFIG,
                          f"llama.cpp could not load {model_path!r}: is it a GGUF model? (check --model)")
    return model, model_params.n_gpu_layers


class LlamaRunner:
    def __init__(self, config: EngineConfig, model_path: str):
        lc.llama_log_set(_quiet_log, None)
        lc.llama_backend_init()
        self.has_gpu = bool(lc.llama_supports_gpu_offload())
        # num_gpu_layers > 0: layers are offloaded (the engine overlaps)
        self.model, self.num_gpu_layers = load_model(model_path, config.n_gpu_layers if self.has_gpu else 0)
        # Reusing part of a sequence's KV needs a model whose memory is positional (recurrent
        # and hybrid models keep one state per sequence). Spare ids hold cached prefixes in
        # the unified pool only: with per-sequence streams each id is a whole stream.
        self.is_recurrent = lc.llama_model_is_recurrent(self.model) or lc.llama_model_is_hybrid(self.model)
        self.has_prefix_cache = config.prefix_cache and not self.is_recurrent
        self.num_seq_ids = config.num_seq_ids if self.has_prefix_cache and config.kv_unified else config.parallel
        self.architecture = self.metadata("general.architecture") or "unknown"
        # An encoder (BERT and its kin declare non-causal attention; a T5 encoder has no
        # decoder) computes embeddings only: it gets no generation context, and the
        # embedder (embedder.py) makes its own.
        self.is_embedding_only = (not lc.llama_model_has_decoder(self.model)
                                  or self.metadata(f"{self.architecture}.attention.causal") == "false")
        self.has_swa = lc.llama_model_n_swa(self.model) > 0
        self.has_backend_sampling = self.has_gpu if config.backend_sampling is None else config.backend_sampling
        self.num_threads = config.num_threads  # of the generation context's decodes (set_threads)
        self.ctx = None if self.is_embedding_only else self._new_context(config)
        self.backend_samplers = BackendSamplers(self.ctx) if self.has_backend_sampling and self.ctx else None
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.memory = lc.llama_get_memory(self.ctx) if self.ctx else None
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.num_cells, self.ctx_per_seq = self._kv_shape(config)
        self.eog_ids = np.array([t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self.vocab, t)], np.int32)
        self._batch = BatchBuffer(config.batch_size)
        self._pieces: dict[int, bytes] = {}
        self.jinja_template = model_template(self.model, self.vocab)  # None: llama.cpp's built-in renderer
        self._piece_buf = ctypes.create_string_buffer(MAX_PIECE_BYTES)
        self._decode_thread: ThreadPoolExecutor | None = None  # made by the first start_decode
        self._decoding: Future | None = None
        self.mark_decoding = no_mark  # the decode worker's crash mark (ring.decode_marker), told around llama_decode
        self.max_token_bytes = self._longest_token_bytes()
        self.vision = load_vision(config, self.model, self.has_gpu, self.ctx is not None, _quiet_log)  # or None
        self.description = self._describe(model_path, self.num_gpu_layers)
        self.model_path = model_path

    def _kv_shape(self, config: EngineConfig) -> tuple[int, int]:
        """(the context's KV cells, the most one sequence holds). With a unified KV pool
        llama.cpp lets any sequence grow to the whole context; the engine caps each at its
        share, so running sequences alone never fill the pool."""
        num_cells = lc.llama_n_ctx(self.ctx) if self.ctx else config.total_ctx
        return num_cells, min(lc.llama_n_ctx_seq(self.ctx) if self.ctx else config.ctx_per_seq,
                              num_cells // config.parallel)

    def _new_context(self, config: EngineConfig):
        """The generation context: every running sequence's KV, one decode per step."""
        ctx_params = lc.llama_context_default_params()
        ctx_params.n_ctx = config.total_ctx
        ctx_params.n_batch = ctx_params.n_ubatch = config.batch_size
        ctx_params.n_seq_max = self.num_seq_ids
        # llama.cpp reserves an output row per sequence id (it asserts at the first decode
        # when ids outnumber the rows), and a step has at most one output per running
        # sequence: so one row per id, not llama.cpp's default of one per batch token
        # (with backend sampling each row costs three vocabulary-sized buffers).
        ctx_params.n_outputs_max = self.num_seq_ids
        if self.has_backend_sampling:
            ctx_params.n_outputs_max_per_seq = 1  # see workers/engine/sampling/backend.py
        ctx_params.n_threads = ctx_params.n_threads_batch = config.num_threads
        ctx_params.kv_unified = config.kv_unified
        # A sliding-window layer normally keeps only each sequence's last window of cells;
        # a reused prefix longer than the window needs the cells before its end, so with
        # the cache on those layers keep full-size KV (memory: see the README).
        ctx_params.swa_full = self.has_prefix_cache and self.has_swa
        ctx_params.no_perf = True
        ctx = lc.llama_init_from_model(self.model, ctx_params)
        if not ctx:
            lc.llama_model_free(self.model)
            raise CbatchError(
                INVALID_CONFIG,
                f"llama.cpp could not create a context of {config.total_ctx} tokens for "
                f"{config.parallel} sequences; lower --ctx-size or --parallel",
            )
        return ctx

    def _describe(self, model_path: str, num_gpu_layers: int) -> str:
        """For the ready line and health(): the model, its file, where it runs and samples."""
        buf = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self.model, buf, len(buf))
        num_layers = lc.llama_model_n_layer(self.model)
        where = f"GPU ({min(num_gpu_layers, num_layers)} of {num_layers} layers)" if num_gpu_layers else "CPU"
        sampling = "in llama.cpp's graph" if self.has_backend_sampling else "on the host"
        serves = "embeddings only" if self.is_embedding_only else f"sampling {sampling}"
        serves += f", takes images (projector {self.vision.path})" if self.vision else ""
        return f"{buf.value.decode(errors='replace')} ({model_path}) on {where}, {serves}"

    def state_fingerprint(self, config: EngineConfig) -> str:
        """What a saved sequence state (seq_states.py) depends on, for the disk tier's
        directory: the model file (its size, head and tail: a GGUF's header names every
        tensor), llama.cpp's build and the CPU features it uses, and the KV layout: its
        streams, sliding-window cache and where its layers run."""
        digest = hashlib.sha256()
        size = os.path.getsize(self.model_path)
        with open(self.model_path, "rb") as model_file:
            digest.update(model_file.read(FINGERPRINT_SAMPLE_BYTES))
            model_file.seek(max(0, size - FINGERPRINT_SAMPLE_BYTES))
            digest.update(model_file.read())
        layout = (size, llama_cpp.__version__, lc.llama_print_system_info(), config.kv_unified,
                  lc.llama_n_seq_max(self.ctx), self.has_swa and self.has_prefix_cache, self.num_gpu_layers)
        digest.update(repr(layout).encode())
        return digest.hexdigest()

    def _longest_token_bytes(self) -> int:
        """At least the most prompt bytes one token can stand for, so a prompt longer than
        this times a sequence's tokens cannot fit. A token's vocabulary text is never
        shorter than what it stands for (a sentencepiece space is 3 bytes, a byte token 6,
        a byte-level BPE byte 1 or 2), and an unknown character is one token of up to 4."""
        get_text, vocab = lc.llama_vocab_get_text, self.vocab
        return max(4, max(len(get_text(vocab, token) or b"") for token in range(self.n_vocab)))

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """BOS is added as the model asks (unless add_special is false); special tokens in
        the text are parsed, so a rendered chat template keeps its turn markers."""
        data = text.encode("utf-8")
        max_tokens = len(data) + 8
        tokens = (lc.llama_token * max_tokens)()
        n = lc.llama_tokenize(self.vocab, data, len(data), tokens, max_tokens, add_special, True)
        if n < 0:
            raise CbatchError(INVALID_REQUEST, "the prompt could not be tokenized")
        return tokens[:n]

    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    def chat_template(self) -> bytes | None:
        """The GGUF's own template; failing that, llama.cpp's built-in template named after
        the model's architecture (some GGUFs, the embedded gemma-3-270m among them, ship
        without tokenizer.chat_template)."""
        template = lc.llama_model_chat_template(self.model, None)
        if template:
            return template
        architecture = self.architecture.encode()
        num_builtin = lc.llama_chat_builtin_templates(None, 0)
        names = (ctypes.c_char_p * num_builtin)()
        lc.llama_chat_builtin_templates(names, num_builtin)
        matches = [name for name in names if name and architecture.startswith(name)]
        return max(matches, key=len) if matches else None

    def render_chat(self, messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...] = ()) -> str:
        """The chat's prompt as the model's own Jinja template writes it (chat_template.py),
        tools and tool turns included, so a conversation renders the same with tools or
        without; llama.cpp's built-in renderer only for a model without a template jinja2
        compiles (the embedded gemma-3-270m has none), which takes no tools."""
        has_tools = bool(tools) or has_tool_turns(messages)
        if has_tools and (self.jinja_template is None or not self.jinja_template.knows_tools):
            raise CbatchError(INVALID_REQUEST, "tools, tool calls and tool results need a chat template that knows "
                                               "tools, and this model's does not: send them through cbatch.Client "
                                               "or the HTTP server, which then describe them in words")
        if self.jinja_template is not None:
            return self.jinja_template.render(*template_input(messages, tools))
        template = self.chat_template()
        if not template:
            raise CbatchError(INVALID_REQUEST, "this model has no chat template: send 'prompt' instead of 'messages'")
        encoded = [(message.role.encode(), message.content.encode()) for message in messages]
        chat = (lc.llama_chat_message * len(encoded))(*(lc.llama_chat_message(r, c) for r, c in encoded))
        size = 2 * sum(len(c) for _, c in encoded) + 1024
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_chat_apply_template(template, chat, len(encoded), True, buf, size)
            if n < 0:
                raise CbatchError(INVALID_REQUEST,
                                  "llama.cpp does not support this model's chat template: send 'prompt'")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1
        raise CbatchError(INVALID_REQUEST, "the chat template output kept growing")

    def token_piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            n = lc.llama_token_to_piece(self.vocab, token, self._piece_buf, MAX_PIECE_BYTES, 0, False)
            piece = self._piece_buf.raw[: max(n, 0)]
            self._pieces[token] = piece
        return piece

    def set_threads(self, num_threads: int) -> None:
        """The compute threads of the next decodes (thread_governor.py); between decodes only."""
        lc.llama_set_n_threads(self.ctx, num_threads, num_threads)
        self.num_threads = num_threads

    def decode(self, spans: list[BatchSpan]) -> int:
        """One llama_decode over the spans; returns llama.cpp's status (0 = ok)."""
        if self.backend_samplers is not None:
            self.backend_samplers.prepare(spans)
        self._batch.fill(spans)
        return marked_decode(self.mark_decoding, request_ids(spans), self.ctx, self._batch.batch)

    def start_decode(self, spans: list[BatchSpan]) -> None:
        """Fill the batch and queue its llama_decode on the decode thread; the caller may
        run Python meanwhile (ctypes releases the GIL) but must call nothing else of this
        runner's context, and no model call that writes, until wait_decode()."""
        if self._decode_thread is None:
            self._decode_thread = ThreadPoolExecutor(1, thread_name_prefix="cbatch-decode")
        if self.backend_samplers is not None:
            self.backend_samplers.prepare(spans)
        self._batch.fill(spans)
        self._decoding = self._decode_thread.submit(marked_decode, self.mark_decoding, request_ids(spans), self.ctx,
                                                    self._batch.batch)

    def wait_decode(self) -> int:
        """The status of the decode that start_decode queued, once it is done."""
        decoding, self._decoding = self._decoding, None
        return decoding.result()

    def logits(self, num_outputs: int) -> np.ndarray:
        """The last decode's logits, one row per span that wanted them, in batch order.
        A view into llama.cpp's buffer: valid (and writable) until the next decode."""
        ptr = lc.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(num_outputs, self.n_vocab))

    def sampled_tokens(self, batch_indices: list[int]) -> list[int]:
        """The tokens the last decode sampled in its graph for those batch rows."""
        return self.backend_samplers.sampled_tokens(batch_indices)

    def release_sampler(self, chain) -> None:
        """Detach a backend-sampled request's chain from the context before it is freed."""
        self.backend_samplers.release(chain)

    def apply_memory_ops(self, ops: list[tuple]) -> list[int]:
        """The KV manager's operations, in order (see workers/engine/kv/base.py). Returns
        the sequence ids whose restore failed (each left empty)."""
        failed_ids = []
        for op in ops:
            if op[0] == OP_COPY:
                _, src, dst, start, end = op
                lc.llama_memory_seq_cp(self.memory, src, dst, start, end)
            elif op[0] == OP_REMOVE:
                _, seq_id, start = op
                lc.llama_memory_seq_rm(self.memory, seq_id, start, -1)
            elif op[0] == OP_SAVE:
                save_entry(self.ctx, self.memory, op[1], op[2])
            else:
                assert op[0] == OP_RESTORE
                if not restore_entry(self.ctx, self.memory, op[1], op[2]):
                    failed_ids.append(op[1])
        return failed_ids

    def close(self) -> None:
        if self._decode_thread is not None:  # a decode in flight finishes before the context goes
            self._decode_thread.shutdown(wait=True)
            self._decode_thread = None
        if self.backend_samplers is not None:
            self.backend_samplers.close()
            self.backend_samplers = None
        if self.vision is not None:
            self.vision.close()
        if self.ctx:
            lc.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            lc.llama_model_free(self.model)
            self.model = None
