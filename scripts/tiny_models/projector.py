"""Write a tiny random-weight vision projector (mmproj) GGUF for the tiny text model.

llama.cpp's mtmd loads it as it loads a LLaVA-1.5 projector: projector type "mlp"
(the simplest one clip.cpp knows: a ViT, then two linear layers with a GELU between),
a CLIP-style vision encoder with learned position embeddings, no class embedding, and
square images resized (padded) to IMAGE_SIZE. With IMAGE_SIZE 32 and PATCH_SIZE 8 every
image becomes (32 / 8)^2 = 16 embeddings ("image tokens") of the text model's width.

The projector's output width must equal the text model's n_embd (mtmd refuses the pair
otherwise): `--n-embd-text` writes one for another model, e.g. one that does not fit.
Byte-identical on every run (fixed numpy seed).

Written by `python scripts/make_tiny_model.py --kind projector OUT_PATH [--n-embd-text N]`.
"""

from __future__ import annotations

import os

import gguf
import numpy as np

from tiny_models.gguf_files import RandomTensors, finish_writing, write_atomically
from tiny_models.llama import N_EMBD as TEXT_N_EMBD

SEED = 2468
N_EMBD, N_LAYER, N_HEAD, N_FF, N_PROJ_HIDDEN = 32, 1, 2, 48, 48
IMAGE_SIZE, PATCH_SIZE = 32, 8
NUM_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2  # image tokens per image
NORM_EPS = 1e-6
IMAGE_MEAN, IMAGE_STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
OUTPUT_SCALE = 4.0


def build_tensors(n_embd_text: int) -> dict[str, np.ndarray]:
    random = RandomTensors(SEED, N_EMBD)
    normal, linear, norm = random.normal, random.linear, random.norm
    tensors = {"v.patch_embd.weight": normal(N_EMBD, 3, PATCH_SIZE, PATCH_SIZE, scale=1.0 / PATCH_SIZE),
               "v.position_embd.weight": normal(NUM_PATCHES, N_EMBD, scale=0.1)}
    for i in range(N_LAYER):
        blk = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors.update(linear(f"{blk}.{name}", N_EMBD, N_EMBD))
        tensors.update(norm(f"{blk}.ln1"))
        tensors.update(norm(f"{blk}.ln2"))
        # N_FF != N_EMBD: clip.cpp takes ffn_down of width n_embd as a legacy swapped pair.
        tensors.update(linear(f"{blk}.ffn_up", N_FF, N_EMBD))
        tensors.update(linear(f"{blk}.ffn_down", N_EMBD, N_FF))
    tensors.update(linear("mm.0", N_PROJ_HIDDEN, N_EMBD))
    tensors.update(linear("mm.2", n_embd_text, N_PROJ_HIDDEN))
    # Image embeddings as large as the text model's token embeddings (unit normal), so that
    # different images lead a greedy answer apart within a few tokens.
    tensors["mm.2.weight"] *= OUTPUT_SCALE
    return tensors


def write_gguf(path: str, n_embd_text: int) -> None:
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_name("cbatch-tiny-projector")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.embedding_length", N_EMBD)
    writer.add_uint32("clip.vision.feed_forward_length", N_FF)
    writer.add_uint32("clip.vision.block_count", N_LAYER)
    writer.add_uint32("clip.vision.attention.head_count", N_HEAD)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", NORM_EPS)
    writer.add_uint32("clip.vision.projection_dim", n_embd_text)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_array("clip.vision.image_mean", IMAGE_MEAN)
    writer.add_array("clip.vision.image_std", IMAGE_STD)
    finish_writing(writer, build_tensors(n_embd_text))


def make_tiny_projector(path: str | os.PathLike[str], n_embd_text: int = TEXT_N_EMBD) -> str:
    """Write the projector to `path` (atomically; untouched if already identical)."""
    return write_atomically(path, lambda tmp: write_gguf(tmp, n_embd_text))
