"""Images in prompts: the model's vision projector (cbatch-worker --mmproj), through
llama.cpp's mtmd, and a prompt with images made into tokens and image embeddings.

Off the decode loop (the preparer threads call prompt_with_images): each image file is
checked (image_files.py), decoded, and run through the vision encoder (unless the same
pixels were encoded lately), into an ImageSpan: its embeddings and the positions it takes
in the prompt. The prompt's token
list holds a placeholder id at each of those positions, derived from the hash of the
image's pixels: the prefix cache and the engine's forks compare token lists, so a prompt
with the same image and text reuses (or shares) its KV exactly as a text prompt does, and
a different image never matches. Placeholders are negative, never a vocabulary id.
The embeddings enter the sequence's KV in the step (image_steps.py).

Supported: projectors whose image embeddings take one position each and attend causally
(LLaVA-style MLP projectors among them). Qwen2-VL's M-RoPE positions and Gemma 3's
non-causal image attention are refused at load (not done yet).
"""

import ctypes
import hashlib
import threading
from dataclasses import dataclass

import llama_cpp.llama_cpp as lc
import numpy as np
from llama_cpp import mtmd_cpp as mtmd

from cbatch.config import EngineConfig
from cbatch.errors import INVALID_CONFIG, INVALID_REQUEST, CbatchError
from cbatch.images import IMAGE_MARKER
from cbatch.workers.engine.image_files import FORMATS, check_image_files

MTMD_INPUT_CHUNK_TYPE_TEXT, MTMD_INPUT_CHUNK_TYPE_IMAGE = 0, 1
NUM_ID_WORDS = 8  # placeholder ids cycle through the pixel hash's 8 32-bit words
# Embeddings of recently encoded images kept, so that the same image in many requests is
# encoded once (a 576-position image of a 4096-wide model is 9 MiB).
MAX_ENCODED_BYTES = 64 << 20


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """An image's embeddings (one row per position) at prompt positions [start, end)."""

    start: int
    embeddings: np.ndarray  # float32, (positions, the model's input width)

    @property
    def end(self) -> int:
        return self.start + len(self.embeddings)


def placeholder_ids(pixels_digest: bytes, num_positions: int) -> list[int]:
    """Negative ids from the hash of an image's pixels: two images match only if their
    hashes' words do, position by position."""
    words = [int.from_bytes(pixels_digest[4 * i:4 * i + 4], "little") & 0x7FFFFFFF for i in range(NUM_ID_WORDS)]
    return [-1 - words[i % NUM_ID_WORDS] for i in range(num_positions)]


class Vision:
    """The mtmd context of the model's projector; its calls are serialized (the two
    preparer threads share it; mtmd's encoder is not safe to enter twice at once)."""

    def __init__(self, config: EngineConfig, model, use_gpu: bool, log_callback):
        self.path, self._config = config.mmproj_path, config  # the config's bounds on images
        mtmd.mtmd_helper_log_set(log_callback, None)  # mtmd logs every image it takes: the runner's filter
        params = mtmd.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.print_timings = use_gpu, config.num_threads, False
        params.media_marker = IMAGE_MARKER.encode()
        self.ctx = mtmd.mtmd_init_from_file(self.path.encode(), model, params)
        self.num_embd = lc.llama_model_n_embd_inp(model)
        if not self.ctx:
            raise CbatchError(INVALID_CONFIG, f"llama.cpp could not load the projector {self.path!r} for this model: "
                                              f"is it an mmproj GGUF made for it (its output width must be the "
                                              f"model's {self.num_embd})? (check --mmproj)")
        why_not = ("it has no vision encoder" if not mtmd.mtmd_support_vision(self.ctx) else
                   "its model places images by M-RoPE positions (Qwen2-VL and kin), not supported yet"
                   if mtmd.mtmd_decode_use_mrope(self.ctx) else
                   "its images attend non-causally (Gemma 3 and kin), not supported yet"
                   if mtmd.mtmd_decode_use_non_causal(self.ctx, None) else "")
        if why_not:
            self.close()
            raise CbatchError(INVALID_CONFIG, f"--mmproj {self.path}: {why_not}")
        self._lock = threading.Lock()
        self._encoded: dict[bytes, np.ndarray] = {}  # pixel hash -> embeddings, least recently used first
        self.num_encoded = 0  # vision encoder runs

    def prompt_with_images(self, text: str, images: tuple[bytes, ...]) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """The prompt's tokens (a placeholder at each image position) and its images, one
        per IMAGE_MARKER in `text`, in order. Raises INVALID_REQUEST for a bad image."""
        check_image_files(images, self._config)
        with self._lock:
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * len(images))()
            chunks = mtmd.mtmd_input_chunks_init()
            try:
                digests = [self._decode(i, data, bitmaps) for i, data in enumerate(images)]
                data = text.encode("utf-8")
                # BOS as the model asks and special tokens parsed, as LlamaRunner.tokenize.
                text_in = mtmd.mtmd_input_text(data, len(data), True, True)
                if mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text_in), bitmaps, len(images)) != 0:
                    raise CbatchError(INVALID_REQUEST, "images: the projector could not take them")
                return self._encode(chunks, digests)
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
                for bitmap in bitmaps:
                    if bitmap:
                        mtmd.mtmd_bitmap_free(bitmap)

    def _decode(self, index: int, data: bytes, bitmaps) -> bytes:
        """Decode images[index] into bitmaps[index]; returns the hash of its pixels."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
        if not bitmap:
            raise CbatchError(INVALID_REQUEST, f"images[{index}] could not be decoded as a {FORMATS} image")
        bitmaps[index] = bitmap
        width, height = mtmd.mtmd_bitmap_get_nx(bitmap), mtmd.mtmd_bitmap_get_ny(bitmap)
        pixels = ctypes.string_at(mtmd.mtmd_bitmap_get_data(bitmap), mtmd.mtmd_bitmap_get_n_bytes(bitmap))
        return hashlib.blake2b(pixels, person=f"{width}x{height}".encode()[:16]).digest()

    def _encode(self, chunks, digests: list[bytes]) -> tuple[list[int], tuple[ImageSpan, ...]]:
        prompt_ids, spans = [], []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == MTMD_INPUT_CHUNK_TYPE_TEXT:
                num_tokens = ctypes.c_size_t()
                tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(num_tokens))
                prompt_ids += tokens[:num_tokens.value]
                continue
            num_positions = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            if mtmd.mtmd_input_chunk_get_n_pos(chunk) != num_positions:  # HunyuanVL's layout, say
                raise CbatchError(INVALID_REQUEST, "images: this projector lays an image's embeddings over positions "
                                                   "of its own, not supported yet")
            digest = digests[len(spans)]
            spans.append(ImageSpan(len(prompt_ids), self._embeddings(len(spans), chunk, digest, num_positions)))
            prompt_ids += placeholder_ids(digest, num_positions)
        return prompt_ids, tuple(spans)

    def _embeddings(self, index: int, chunk, digest: bytes, num_positions: int) -> np.ndarray:
        """The image chunk's embeddings: the encoder's, or those of the same pixels encoded before."""
        embeddings = self._encoded.pop(digest, None)
        if embeddings is None:
            if mtmd.mtmd_encode_chunk(self.ctx, chunk) != 0:
                raise CbatchError(INVALID_REQUEST, f"images[{index}]: the vision encoder failed on it")
            self.num_encoded += 1
            output = mtmd.mtmd_get_output_embd(self.ctx)
            embeddings = np.ctypeslib.as_array(output, shape=(num_positions, self.num_embd)).copy()
            embeddings.flags.writeable = False  # shared by every request with these pixels
        self._encoded[digest] = embeddings  # the most recently used last
        while sum(e.nbytes for e in self._encoded.values()) > MAX_ENCODED_BYTES and len(self._encoded) > 1:
            del self._encoded[next(iter(self._encoded))]
        return embeddings

    def close(self) -> None:
        if self.ctx:
            mtmd.mtmd_free(self.ctx)
            self.ctx = None


def load_vision(config: EngineConfig, model, use_gpu: bool, has_generation: bool, log_callback) -> Vision | None:
    """The projector of --mmproj, or None without one; mtmd logs through `log_callback`."""
    if config.mmproj_path is None:
        return None
    if not has_generation:
        raise CbatchError(INVALID_CONFIG, "--mmproj needs a generative model; this one only computes embeddings")
    return Vision(config, model, use_gpu, log_callback)
