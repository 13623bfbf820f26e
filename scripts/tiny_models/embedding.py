"""Write a tiny random-weight BERT GGUF: an embedding-only model for fast tests.

llama.cpp runs it as it runs bge or all-MiniLM: architecture "bert" (non-causal
attention, declared by bert.attention.causal = false), a WordPiece ("bert") vocabulary
with [PAD] [UNK] [CLS] [SEP] [MASK], token-type and learned position embeddings, post-norm
layers with biases, and the pooling it declares (bert.pooling_type: mean by default, or cls).

The vocabulary: the special tokens, then every printable ASCII character twice, as a
word start ("▁a", llama.cpp's form of a word-initial WordPiece) and as a continuation
("a", WordPiece's "##a"), and a few whole words; so any ASCII text tokenizes, character by
character where no word matches. Byte-identical on every run (fixed numpy seed).

Written by `python scripts/make_tiny_model.py --kind embedding OUT_PATH [--pooling mean|cls]`.
"""

from __future__ import annotations

import os

import gguf
import numpy as np

from tiny_models.gguf_files import RandomTensors, finish_writing, new_writer, write_atomically

SEED = 4321
N_EMBD, N_LAYER, N_HEAD, N_FF = 32, 2, 2, 64
CONTEXT_LENGTH = 128  # positions the model has embeddings for: the longest input it takes
NORM_EPS = 1e-12
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)
WORDS = ["the", "cat", "dog", "sat", "on", "mat", "hello", "world", "embed", "text"]
POOLING = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS}


def build_vocab() -> list[str]:
    chars = [chr(c) for c in range(0x21, 0x7F)]  # printable, less the space WordPiece splits on
    return SPECIAL_TOKENS + ["\u2581" + c for c in chars] + chars + ["\u2581" + word for word in WORDS]


def build_tensors(n_vocab: int) -> dict[str, np.ndarray]:
    random = RandomTensors(SEED, N_EMBD)
    normal, linear, norm = random.normal, random.linear, random.norm
    tensors = {"token_embd.weight": normal(n_vocab, N_EMBD), "token_types.weight": normal(2, N_EMBD, scale=0.1),
               "position_embd.weight": normal(CONTEXT_LENGTH, N_EMBD, scale=0.1), **norm("token_embd_norm")}
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensors |= linear(f"{blk}.{name}", N_EMBD, N_EMBD)
        tensors |= norm(f"{blk}.attn_output_norm")
        tensors |= linear(f"{blk}.ffn_up", N_FF, N_EMBD) | linear(f"{blk}.ffn_down", N_EMBD, N_FF)
        tensors |= norm(f"{blk}.layer_output_norm")
    return tensors


def write_gguf(path: str, pooling: str) -> None:
    tokens = build_vocab()
    writer = new_writer(path, "bert", len(tokens), CONTEXT_LENGTH, N_EMBD, N_LAYER, N_FF, N_HEAD)
    writer.add_layer_norm_eps(NORM_EPS)
    writer.add_causal_attention(False)
    writer.add_pooling_type(POOLING[pooling])
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types([int(gguf.TokenType.CONTROL)] * len(SPECIAL_TOKENS)
                           + [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_type_count(2)
    writer.add_pad_token_id(PAD_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(CLS_ID)  # llama.cpp's BERT vocabulary starts every input with BOS: [CLS]
    writer.add_sep_token_id(SEP_ID)
    writer.add_mask_token_id(MASK_ID)
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    finish_writing(writer, build_tensors(len(tokens)))


def make_tiny_embedding_model(path: str | os.PathLike[str], pooling: str = "mean") -> str:
    """Write the model to `path` atomically; returns its absolute path."""
    if pooling not in POOLING:
        raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {pooling!r}")
    return write_atomically(path, lambda tmp: write_gguf(tmp, pooling))
