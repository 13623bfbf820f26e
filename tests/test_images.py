"""Images in the conversation: the tiny projector (scripts/make_tiny_projector.py) as
llama.cpp's mtmd loads it, and images through the daemon's real paths."""

import ctypes

import llama_cpp.llama_cpp as lc
import pytest
from llama_cpp import mtmd_cpp as mtmd

from conftest import load_script
from imagekit import png_bytes

MTMD_INPUT_CHUNK_TYPE_TEXT, MTMD_INPUT_CHUNK_TYPE_IMAGE = 0, 1


@pytest.fixture(scope="module")
def text_model(tiny_model_path):
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(tiny_model_path.encode(), lc.llama_model_default_params())
    yield model
    lc.llama_model_free(model)


def mtmd_context(projector_path: str, model):
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.warmup, params.print_timings = False, 1, False, False
    return mtmd.mtmd_init_from_file(projector_path.encode(), model, params)


def test_mtmd_loads_the_tiny_projector_and_writes_an_image_into_one_sequence(tiny_projector_path, text_model):
    projector = load_script("make_tiny_projector")
    ctx = mtmd_context(tiny_projector_path, text_model)
    assert ctx and mtmd.mtmd_support_vision(ctx)
    chunks = mtmd.mtmd_input_chunks_init()
    lctx = None
    try:
        data = png_bytes(40, 24)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(data), False)
        assert bitmap and (mtmd.mtmd_bitmap_get_nx(bitmap), mtmd.mtmd_bitmap_get_ny(bitmap)) == (40, 24)
        prompt = b"Describe " + mtmd.mtmd_default_marker() + b" in a word."
        text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        mtmd.mtmd_bitmap_free(bitmap)
        kinds = [mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, i))
                 for i in range(mtmd.mtmd_input_chunks_size(chunks))]
        assert kinds == [MTMD_INPUT_CHUNK_TYPE_TEXT, MTMD_INPUT_CHUNK_TYPE_IMAGE, MTMD_INPUT_CHUNK_TYPE_TEXT]
        image_chunk = mtmd.mtmd_input_chunks_get(chunks, 1)
        assert mtmd.mtmd_input_chunk_get_n_tokens(image_chunk) == projector.NUM_PATCHES

        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 1024, 64, 64, 4
        params.n_threads = params.n_threads_batch = 1
        lctx = lc.llama_init_from_model(text_model, params)
        seq_id, n_past = 2, lc.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, seq_id, 64, True, ctypes.byref(n_past)) == 0
        num_positions = mtmd.mtmd_helper_get_n_pos(chunks)
        assert n_past.value == num_positions > projector.NUM_PATCHES
        memory = lc.llama_get_memory(lctx)
        assert lc.llama_memory_seq_pos_max(memory, seq_id) == num_positions - 1
        assert lc.llama_memory_seq_pos_max(memory, 0) == -1  # the other sequences are untouched
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        if lctx:
            lc.llama_free(lctx)
        mtmd.mtmd_free(ctx)


def test_mtmd_refuses_a_projector_whose_width_is_not_the_models(tmp_path, text_model):
    path = load_script("make_tiny_projector").make_tiny_projector(tmp_path / "narrow.gguf", n_embd_text=32)
    assert not mtmd_context(path, text_model)
