"""What the tiny models' writers share: a float32 GGUF's writer with the hyperparameters
every architecture has, seeded tensors, and writing a file atomically."""

from __future__ import annotations

import filecmp
import os
import tempfile
from pathlib import Path
from typing import Callable

import gguf
import numpy as np


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
