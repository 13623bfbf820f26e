"""Write a tiny random-weight llama GGUF model for fast, deterministic engine tests.

Real models are large and slow to load; this one is about 0.5 MB, loads in
milliseconds, and is byte-identical on every run (fixed numpy seed), so tests can
compare token streams exactly. The vocabulary is SentencePiece-style ("llama")
and byte-level: <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF> and "▁", so
any text (multi-byte UTF-8 included) tokenizes through byte fallback and
detokenizes back to the same bytes.

A constant "bias channel" (residual dimension 0) lets the output head push down
the special tokens and non-printable bytes, so greedy decoding never stops on
EOS and emits varied printable ASCII.

It has no chat template (llama.cpp renders chats with its built-in template for the
architecture) unless given one: `--chat-template scripts/chatml_tools.jinja` writes one
that knows tools, for the tool-calling tests.

Written by `python scripts/make_tiny_model.py [OUT_PATH] [--chat-template FILE]`.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

from tiny_models.gguf_files import finish_writing, new_writer, write_atomically

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "models" / "tiny-llama.gguf"

SEED = 1234
N_EMBD, N_LAYER, N_HEAD, N_HEAD_KV, N_FF = 64, 2, 4, 2, 128
CONTEXT_LENGTH = 4096
RMS_EPS = 1e-5
ROPE_FREQ_BASE = 10000.0
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_BYTE_ID = 3                     # <0x00> is id 3, <0xFF> is id 258
SPACE_ID = FIRST_BYTE_ID + 256        # "▁" (id 259): spaces round-trip as " "
BIAS_CHANNEL, BIAS_VALUE, PENALTY = 0, 1.0, -30.0


def build_vocab(num_tokens: int | None = None, user_defined: tuple[str, ...] = ()) -> tuple[list[str], list[int]]:
    """The byte-level vocabulary; `num_tokens` pads it with filler words ("▁w<i>") to a
    full-size vocabulary, for measuring per-step work that scales with its size;
    `user_defined` adds tokens of that type at the end (as Qwen's `<tool_call>`)."""
    T = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL]
    num_fillers = max(0, (num_tokens or 0) - len(tokens))
    tokens += [f"\u2581w{i}" for i in range(num_fillers)] + list(user_defined)
    types += [T.NORMAL] * num_fillers + [T.USER_DEFINED] * len(user_defined)
    return tokens, [int(t) for t in types]


def penalized_token_ids(n_vocab: int) -> np.ndarray:
    """Tokens greedy decoding should never pick: specials and non-printable bytes."""
    allowed = [FIRST_BYTE_ID + b for b in range(0x20, 0x7F)] + [FIRST_BYTE_ID + 0x0A, SPACE_ID]
    return np.setdiff1d(np.arange(n_vocab), allowed)


def build_tensors(n_vocab: int) -> dict[str, np.ndarray]:
    """numpy shape is (out, in); gguf reverses it into llama.cpp's ne = {in, out}."""
    rng = np.random.default_rng(SEED)
    head_dim = N_EMBD // N_HEAD

    def linear(n_out: int, n_in: int) -> np.ndarray:
        return rng.normal(0.0, 1.0 / np.sqrt(n_in), (n_out, n_in)).astype(np.float32)

    embd = rng.normal(0.0, 1.0, (n_vocab, N_EMBD)).astype(np.float32)
    embd[:, BIAS_CHANNEL] = BIAS_VALUE
    tensors = {"token_embd.weight": embd}
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        tensors[f"{blk}.attn_norm.weight"] = np.ones(N_EMBD, np.float32)
        tensors[f"{blk}.attn_q.weight"] = linear(N_HEAD * head_dim, N_EMBD)
        tensors[f"{blk}.attn_k.weight"] = linear(N_HEAD_KV * head_dim, N_EMBD)
        tensors[f"{blk}.attn_v.weight"] = linear(N_HEAD_KV * head_dim, N_EMBD)
        tensors[f"{blk}.attn_output.weight"] = linear(N_EMBD, N_HEAD * head_dim)
        tensors[f"{blk}.ffn_norm.weight"] = np.ones(N_EMBD, np.float32)
        tensors[f"{blk}.ffn_gate.weight"] = linear(N_FF, N_EMBD)
        tensors[f"{blk}.ffn_up.weight"] = linear(N_FF, N_EMBD)
        tensors[f"{blk}.ffn_down.weight"] = linear(N_EMBD, N_FF)
        # Layers never write the bias channel, so it stays constant in the residual.
        tensors[f"{blk}.attn_output.weight"][BIAS_CHANNEL] = 0.0
        tensors[f"{blk}.ffn_down.weight"][BIAS_CHANNEL] = 0.0
    tensors["output_norm.weight"] = np.ones(N_EMBD, np.float32)
    output = linear(n_vocab, N_EMBD) * 4.0  # sharper logits: varied greedy output
    output[:, BIAS_CHANNEL] = 0.0
    output[penalized_token_ids(n_vocab), BIAS_CHANNEL] = PENALTY
    tensors["output.weight"] = output
    return tensors


def write_gguf(path: str, num_tokens: int | None = None, chat_template: str | None = None,
               user_defined: tuple[str, ...] = ()) -> None:
    tokens, token_types = build_vocab(num_tokens, user_defined)
    writer = new_writer(path, "llama", len(tokens), CONTEXT_LENGTH, N_EMBD, N_LAYER, N_FF, N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)  # exact text round-trip, no leading " "
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    finish_writing(writer, build_tensors(len(tokens)))


def make_tiny_model(path: str | os.PathLike[str] = DEFAULT_PATH, num_tokens: int | None = None,
                    chat_template: str | None = None, user_defined: tuple[str, ...] = ()) -> str:
    """Write the model to `path` (atomically; untouched if already identical); see
    build_vocab for `num_tokens` and `user_defined`; `chat_template` is the Jinja text of its template."""
    return write_atomically(path, lambda tmp: write_gguf(tmp, num_tokens, chat_template, user_defined))
