"""Images in the conversation: the tiny projector (scripts/tiny_models/projector.py) as
llama.cpp's mtmd loads it, and images through the daemon's real paths."""

import ctypes

import llama_cpp.llama_cpp as lc
import pytest
from conftest import load_script
from imagekit import png_bytes
from llama_cpp import mtmd_cpp as mtmd

from cbatch.params import parse_request

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
    projector = load_script("make_tiny_model").projector
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
    path = load_script("make_tiny_model").projector.make_tiny_projector(tmp_path / "narrow.gguf", n_embd_text=32)
    assert not mtmd_context(path, text_model)


GREEDY_8 = {"temperature": 0, "ignore_eos": True, "max_tokens": 8}
IMAGE_PROMPT = "Describe <__media__> in a word."


@pytest.fixture
def make_vision_engine(make_engine, tiny_projector_path):
    return lambda **overrides: make_engine(mmproj_path=tiny_projector_path, **overrides)


def run_engine(engine, bodies: list[dict]) -> list[list[int]]:
    """Each body's generated token ids, the bodies submitted together."""
    for i, body in enumerate(bodies):
        engine.add(engine.prepare(parse_request(i, {**GREEDY_8, **body})))
    tokens = {i: [] for i in range(len(bodies))}
    while engine.has_work:
        for event in engine.step():
            assert event.error is None, event.error
            tokens[event.request_id] += event.token_ids
    return [tokens[i] for i in range(len(bodies))]


def reference_tokens(text_model, projector_path: str, image: bytes, num_tokens: int) -> list[int]:
    """Greedy tokens after IMAGE_PROMPT with `image`, as llama.cpp's own mtmd helper computes them."""
    ctx = mtmd_context(projector_path, text_model)
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_threads, params.n_threads_batch = 256, 64, 64, 1, 1
    lctx = lc.llama_init_from_model(text_model, params)
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        buf = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(mtmd.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(image), False))
        prompt = IMAGE_PROMPT.encode()
        text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) == 0
        mtmd.mtmd_bitmap_free(bitmaps[0])
        n_past = lc.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, 64, True, ctypes.byref(n_past)) == 0
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(text_model))
        tokens = []
        for _ in range(num_tokens):
            logits = lc.llama_get_logits_ith(lctx, -1)
            tokens.append(max(range(n_vocab), key=lambda t: logits[t]))
            batch = lc.llama_batch_get_one((lc.llama_token * 1)(tokens[-1]), 1)
            assert lc.llama_decode(lctx, batch) == 0
        return tokens
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        lc.llama_free(lctx)
        mtmd.mtmd_free(ctx)


def test_an_image_prompt_generates_what_llama_cpps_own_helper_does(make_vision_engine, tiny_projector_path,
                                                                   text_model):
    image = png_bytes(40, 24)
    expected = reference_tokens(text_model, tiny_projector_path, image, 8)
    assert run_engine(make_vision_engine(), [{"prompt": IMAGE_PROMPT, "images": [image]}]) == [expected]


@pytest.mark.parametrize("overrides", [{"batch_size": 6}, {"overlap": True}, {"kv_unified": True}],
                         ids=["image-over-several-steps", "overlap", "unified-pool"])
def test_images_beside_text_streams_whatever_the_step_layout(make_engine, make_vision_engine, overrides):
    text_alone = run_engine(make_engine(), [{"prompt": "plain text"}])
    bodies = [{"prompt": "plain text"}, {"prompt": IMAGE_PROMPT, "images": [png_bytes(40, 24)]},
              {"prompt": IMAGE_PROMPT, "images": [png_bytes(40, 24, seed=5)]}]
    whole = run_engine(make_vision_engine(), bodies)
    assert whole[0] == text_alone[0]  # the text stream's tokens are unchanged by the images beside it
    assert whole[1] != whole[2]  # the image decides the answer
    assert run_engine(make_vision_engine(**overrides), bodies) == whole


def test_image_chunks_go_interactive_first_and_batch_ones_within_their_share(make_vision_engine):
    engine = make_vision_engine(batch_size=8)
    batch = engine.prepare(parse_request(0, {**GREEDY_8, "prompt": IMAGE_PROMPT, "images": [png_bytes(40, 24)],
                                             "priority": "batch"}))
    interactive = engine.prepare(parse_request(1, {**GREEDY_8, "prompt": IMAGE_PROMPT,
                                                   "images": [png_bytes(40, 24, seed=5)]}))

    def written(seq) -> int:
        image = seq.images[0]
        return min(max(seq.num_cached - image.start, 0), image.end - image.start)

    engine.add(batch)  # alone, it takes whole steps, into its image
    while written(batch) == 0:
        engine.step()
    engine.add(interactive)  # image chunks in admission order would go on serving the batch one first
    steps = []
    while written(interactive) < interactive.images[0].end - interactive.images[0].start:
        before = written(batch), written(interactive)
        engine.step()
        steps.append((written(batch) - before[0], written(interactive) - before[1]))
    # Beside the interactive image, the batch one gets at most a quarter of each step.
    assert all(num_batch <= 8 // 4 for num_batch, _ in steps), steps
    assert written(batch) < batch.images[0].end - batch.images[0].start, steps


def test_the_same_image_in_two_requests_is_computed_once(make_vision_engine):
    engine = make_vision_engine()
    image_request = {"prompt": IMAGE_PROMPT, "images": [png_bytes(40, 24)]}
    first, second = run_engine(engine, [image_request, image_request])
    snapshot = engine.snapshot()
    assert first == second
    num_prompt_tokens = engine.prepare(parse_request(9, image_request)).num_prompt_tokens
    assert snapshot["prompt_tokens_reused"] == num_prompt_tokens  # the second copied the first's KV


def test_the_same_image_in_eight_concurrent_requests_is_encoded_once(make_vision_engine):
    engine = make_vision_engine()
    same = {"prompt": IMAGE_PROMPT, "images": [png_bytes(40, 24)]}
    answers = run_engine(engine, [same] * 8 + [{"prompt": IMAGE_PROMPT, "images": [png_bytes(40, 24, seed=5)]}])
    assert answers[:8] == [answers[0]] * 8 and answers[8] != answers[0]
    assert engine.runner.vision.num_encoded == 2


def test_images_travel_from_the_front_end_to_the_worker_as_they_were_sent():
    from cbatch.workers.messages import WorkerSubmit, decode, encode

    images = [png_bytes(4, 4), png_bytes(8, 8)]
    parsed = parse_request(7, {"messages": [{"role": "user", "content": "<__media__> and <__media__>?"}],
                               "images": images})
    submit = decode(encode(WorkerSubmit(parsed)))
    assert submit.request == parsed and parsed.images == tuple(images)


@pytest.mark.parametrize("body, named", [
    ({"prompt": "no marker", "images": [b"\x89PNG"]}, "1 images but 0 <__media__> markers"),
    ({"prompt": "<__media__> <__media__>", "images": [b"\x89PNG"]}, "1 images but 2"),
    ({"prompt": "<__media__>", "images": ["not bytes"]}, "images must be a list"),
    ({"prompt": "<__media__>", "images": [b""]}, "none empty"),
    ({"prompt": "<__media__>", "images": [bytes(2_000_001)]}, "larger than 2000000 bytes"),
], ids=["no-marker", "extra-marker", "text", "empty", "past-the-wire-limit"])
def test_images_that_do_not_match_their_markers_are_refused_at_the_edge(body, named):
    from cbatch.errors import CbatchError

    with pytest.raises(CbatchError, match=named):
        parse_request(1, body)


def test_a_request_with_images_is_prepared_beside_short_text_ones_not_before_them():
    from common import worker_submit

    from cbatch.workers.decode.preparer import is_large_prompt

    assert is_large_prompt(worker_submit(1, {"prompt": "<__media__>?", "images": [png_bytes(4, 4)]}))
    assert not is_large_prompt(worker_submit(2, {"prompt": "?"}))


def test_an_image_conversation_back_after_its_slot_was_taken_restores_its_state_and_only_its_image(
        make_vision_engine):
    """The image's pixel hash is in the host tier's key as it is in the slots'."""
    prompt = IMAGE_PROMPT + " Then tell me about its colours and shapes," + " in detail" * 12
    image, other_image = png_bytes(40, 24), png_bytes(40, 24, seed=5)
    engine = make_vision_engine(parallel=1)
    run_engine(engine, [{"prompt": prompt, "images": [image]}])
    run_engine(engine, [{"prompt": "Something else entirely, " * 12}])  # takes the only slot: the image turn is saved
    returning = {"prompt": prompt + " And the light?", "images": [image]}
    assert run_engine(engine, [returning]) == run_engine(make_vision_engine(), [returning])
    assert engine.snapshot()["host_cache_hits"] == 1
    run_engine(engine, [{"prompt": "Something else entirely, " * 12}])  # restored itself, and saves the image turn
    hits = engine.snapshot()["host_cache_hits"]
    run_engine(engine, [{**returning, "images": [other_image]}])
    assert engine.snapshot()["host_cache_hits"] == hits  # another image: nothing of the saved state matches
