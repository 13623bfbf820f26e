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

Usage: python scripts/make_tiny_model.py [OUT_PATH] [--chat-template FILE]   (prints the path written)
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "models" / "tiny-llama.gguf"

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


class RandomTensors:
    """Seeded float32 tensors for the tiny models' layers with biases (the embedding and
    vision scripts'): numpy's shape is (out, in), which gguf reverses into ggml's ne = {in, out}.
    Draws happen in call order, so one seed and one order write the same bytes every run."""

    def __init__(self, seed: int, n_embd: int):
        self._rng, self._n_embd = np.random.default_rng(seed), n_embd

    def normal(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        return self._rng.normal(0.0, scale, shape).astype(np.float32)

    def linear(self, name: str, n_out: int, n_in: int) -> dict[str, np.ndarray]:
        return {f"{name}.weight": self.normal(n_out, n_in, scale=1.0 / np.sqrt(n_in)),
                f"{name}.bias": self.normal(n_out, scale=0.1)}

    def norm(self, name: str) -> dict[str, np.ndarray]:
        return {f"{name}.weight": np.ones(self._n_embd, np.float32), f"{name}.bias": np.zeros(self._n_embd, np.float32)}


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


def new_writer(path: str, architecture: str, n_vocab: int, n_ctx: int, n_embd: int, n_layer: int, n_ff: int,
               n_head: int) -> gguf.GGUFWriter:
    """A float32 GGUF's writer with the hyperparameters every architecture has."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name(f"cbatch-tiny-{architecture}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    return writer


def finish_writing(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_tiny_model(path: str | os.PathLike[str] = DEFAULT_PATH, num_tokens: int | None = None,
                    chat_template: str | None = None, user_defined: tuple[str, ...] = ()) -> str:
    """Write the model to `path` (atomically; untouched if already identical); see
    build_vocab for `num_tokens` and `user_defined`; `chat_template` is the Jinja text of its template."""
    return write_atomically(path, lambda tmp: write_gguf(tmp, num_tokens, chat_template, user_defined))


def write_atomically(path: str | os.PathLike[str], write: Callable[[str], None]) -> str:
    """Run write(temporary path) beside `path`, then move the file into place (left
    untouched if already identical); returns the absolute path."""
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tiny-", suffix=".gguf", dir=target.parent)
    os.close(fd)
    os.chmod(tmp, 0o644)
    try:
        write(tmp)
        if target.exists() and filecmp.cmp(tmp, target, shallow=False):
            os.unlink(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return str(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the tiny random-weight test model.")
    parser.add_argument("path", nargs="?", default=DEFAULT_PATH)
    parser.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to embed")
    args = parser.parse_args(argv)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    print(make_tiny_model(args.path, chat_template=template))
    return 0


if __name__ == "__main__":
    sys.exit(main())
