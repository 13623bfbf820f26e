"""What the engine asks of its model: the one interface between the engine's parts and
llama.cpp. `runner.py`'s LlamaRunner is the real one; the tests' fake runner (no model)
meets the same interface, so the engine runs unchanged on either.

A runner owns one llama.cpp context. Every call but tokenize, token_piece, render_chat
and metadata belongs to the decode loop's thread (the preparers call those four, which
only read the model); between start_decode and wait_decode nothing else of the context
may be called.
"""

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from cbatch.chat_messages import ChatMessage, ToolSpec

if TYPE_CHECKING:
    from cbatch.workers.engine.sched.step_batch import BatchSpan
    from cbatch.workers.engine.vision import Vision


@runtime_checkable
class ModelRunner(Protocol):
    # The KV's shape, fixed at load.
    num_cells: int  # the context's KV cells, all sequences together
    num_seq_ids: int  # KV sequence ids the engine may use
    ctx_per_seq: int  # the most tokens one sequence holds
    has_prefix_cache: bool
    has_swa: bool  # sliding-window layers: a saved state keeps only the window's cells
    is_recurrent: bool  # recurrent or hybrid: no prefix cache, no forks
    # What the model is and where it runs.
    is_embedding_only: bool
    has_backend_sampling: bool  # sampler chains run inside the decode's graph
    num_gpu_layers: int  # > 0: the engine overlaps a step's host work with the next decode
    num_threads: int
    architecture: str
    description: str
    model: Any  # llama.cpp's model handle (None without a model)
    ctx: Any  # llama.cpp's context handle (None without a model)
    # The vocabulary.
    vocab: Any  # llama.cpp's vocabulary handle, for sampler chains (None without a model)
    n_vocab: int
    eog_ids: np.ndarray  # int32, every end-of-generation token
    max_token_bytes: int  # the longest token's text
    jinja_template: Any  # the model's own chat template (chat_template.ChatTemplate), None without one
    vision: "Vision | None"  # the vision projector, with --mmproj
    mark_decoding: Any  # called with the step's request ids around llama_decode (the crash mark)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...
    def token_piece(self, token: int) -> bytes: ...
    def chat_template(self) -> bytes | None: ...
    def render_chat(self, messages: tuple[ChatMessage, ...], tools: tuple[ToolSpec, ...] = ()) -> str: ...
    def metadata(self, key: str) -> str | None: ...
    def set_threads(self, num_threads: int) -> None: ...
    def decode(self, spans: "list[BatchSpan]") -> int: ...
    def start_decode(self, spans: "list[BatchSpan]") -> None: ...
    def wait_decode(self) -> int: ...
    def logits(self, num_outputs: int) -> np.ndarray: ...
    def sampled_tokens(self, batch_indices: list[int]) -> list[int]: ...
    def release_sampler(self, chain) -> None: ...
    def apply_memory_ops(self, ops: list[tuple]) -> list[int]: ...
    def state_fingerprint(self, config) -> str: ...
    def close(self) -> None: ...
