"""Images through the real daemon: cbatch-worker --mmproj with the tiny projector, OpenAI
image_url parts over HTTP, images over ZeroMQ, and every bad image a 400 that changes nothing."""

import base64
import concurrent.futures

import httpx
import pytest
from daemonkit import serve_module
from imagekit import image_part, png_bomb, png_bytes

MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS = 20_000, 10_000
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def daemon(tiny_tools_model_path, tiny_projector_path):
    from httpkit import HttpDaemon

    yield from serve_module(HttpDaemon(tiny_tools_model_path, "--mmproj", tiny_projector_path, "-np", "4",
                                       "-c", "2048", "--max-images", "2", "--max-image-bytes", str(MAX_IMAGE_BYTES),
                                       "--max-image-pixels", str(MAX_IMAGE_PIXELS)))


def chat(daemon, content, **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], **GREEDY, **fields}
    return httpx.post(f"{daemon.base_url}/v1/chat/completions", json=body, timeout=120)


def answer(daemon, content) -> str:
    response = chat(daemon, content)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def question(*images: bytes) -> list[dict]:
    return [{"type": "text", "text": "What is in this picture?"}, *(image_part(image) for image in images)]


def test_the_model_says_it_takes_images(daemon):
    assert "takes images" in daemon.health["model"]
    models = httpx.get(f"{daemon.base_url}/v1/models", timeout=10).json()["data"]
    assert [model["takes_images"] for model in models] == [True]


def test_an_image_part_is_answered_beside_unchanged_text_streams(daemon):
    text_alone = answer(daemon, "Tell me a story.")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = [pool.submit(answer, daemon, "Tell me a story.") for _ in range(2)]
        pictures = [pool.submit(answer, daemon, question(png_bytes(40, 24, seed=seed))) for seed in (0, 5)]
        assert [text.result() for text in texts] == [text_alone] * 2
        first, second = (picture.result() for picture in pictures)
    assert first != second  # the image decides the answer
    assert answer(daemon, question(png_bytes(40, 24))) == first  # and the same image gives the same one
    usage = chat(daemon, question(png_bytes(40, 24))).json()["usage"]
    assert usage["prompt_tokens"] > 16  # the image's 16 positions count as prompt tokens


def test_images_over_zeromq_with_markers_in_the_text(daemon):
    from cbatch.images import IMAGE_MARKER

    with daemon.client() as client:
        result = client.generate(messages=[{"role": "user", "content": f"What is in this picture?\n{IMAGE_MARKER}"}],
                                 images=[png_bytes(40, 24)], **GREEDY)
    assert result.text == answer(daemon, question(png_bytes(40, 24)))
    assert client.info["takes_images"] is True


@pytest.mark.parametrize("image_url, named", [
    ({"url": "https://example.com/cat.png"}, "does not fetch image URLs"),
    ({"url": "data:image/png;base64,@@@@"}, "not valid base64"),
    ({"url": "file:///etc/passwd"}, "must be a data: URL"),
], ids=["http-url", "bad-base64", "other-url"])
def test_an_image_url_that_is_not_inline_base64_is_a_400(daemon, image_url, named):
    response = chat(daemon, [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": image_url}])
    assert response.status_code == 400 and named in response.json()["error"]["message"]


@pytest.mark.parametrize("images, named", [
    ([png_bytes(4, 4)] * 3, "--max-images"),
    ([png_bytes(40, 24) + bytes(MAX_IMAGE_BYTES)], "--max-image-bytes"),
    ([png_bytes(200, 100)], "--max-image-pixels"),
    ([b"GIF89a\x10\x00\x10\x00" + bytes(32)], "could not be decoded"),
    ([b"RIFF....WEBPVP8 "], "is not a PNG, JPEG, GIF or BMP"),
    ([png_bomb(1, 1, 16 << 20)], "inflates to more than the 1x1 pixels"),
], ids=["too-many", "too-large", "too-many-pixels", "broken", "not-an-image", "zlib-bomb"])
def test_a_bad_image_is_a_400_naming_why_and_changes_nothing(daemon, images, named):
    before = answer(daemon, question(png_bytes(40, 24)))
    response = chat(daemon, question(*images))
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"] and response.json()["error"]["code"] == "invalid_request"
    assert answer(daemon, question(png_bytes(40, 24))) == before


def test_without_a_projector_an_image_is_a_400_naming_mmproj(start_http_daemon, tiny_tools_model_path):
    plain = start_http_daemon(tiny_tools_model_path, "-np", "1")
    response = chat(plain, question(png_bytes(40, 24)))
    assert response.status_code == 400 and "--mmproj" in response.json()["error"]["message"]
    models = httpx.get(f"{plain.base_url}/v1/models", timeout=10).json()["data"]
    assert [model["takes_images"] for model in models] == [False]


def test_a_projector_that_does_not_fit_the_model_stops_the_start(start_daemon, tiny_tools_model_path, tmp_path):
    from conftest import load_script

    narrow = load_script("make_tiny_model").projector.make_tiny_projector(tmp_path / "narrow.gguf", n_embd_text=32)
    with pytest.raises(RuntimeError, match="could not load the projector"):
        start_daemon(tiny_tools_model_path, "--mmproj", narrow)


def test_an_openai_batch_file_line_carries_an_image(daemon, tmp_path):
    import json
    import subprocess

    from daemonkit import SCRIPTS_DIR

    lines = [{"custom_id": "picture", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": question(png_bytes(40, 24))}], **GREEDY}},
             {"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": question(b"\x89PNG\r\n\x1a\n")}], **GREEDY}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    process = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(tmp_path / "in.jsonl"), "-o",
                              str(tmp_path / "out.jsonl")], env=daemon.env, capture_output=True, text=True, timeout=120)
    out = {o["custom_id"]: o["response"] for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert out["picture"]["status_code"] == 200, process.stderr
    assert out["picture"]["body"]["choices"][0]["message"]["content"] == answer(daemon, question(png_bytes(40, 24)))
    assert out["broken"]["status_code"] == 400 and "images[0]" in out["broken"]["body"]["error"]["message"]


def test_a_responses_input_image_is_answered_as_the_chat_image_part(daemon):
    from imagekit import data_url

    content = [{"type": "input_text", "text": "What is in this picture?"},
               {"type": "input_image", "image_url": data_url(png_bytes(40, 24))}]
    response = httpx.post(f"{daemon.base_url}/v1/responses", timeout=120, json={
        "input": [{"role": "user", "content": content}], "temperature": 0, "max_output_tokens": 8})
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"] == answer(daemon, question(png_bytes(40, 24)))


def test_a_batch_job_answers_an_image_line_as_the_live_endpoint(daemon):
    import json

    from daemonkit import wait_until

    lines = [{"custom_id": "picture", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": question(png_bytes(40, 24))}], **GREEDY}},
             {"custom_id": "oversized", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": question(png_bytes(200, 200))}], **GREEDY}}]
    with httpx.Client(base_url=daemon.base_url, timeout=60) as http:
        file_id = http.post("/v1/files", data={"purpose": "batch"}, files={
            "file": ("in.jsonl", "".join(json.dumps(line) + "\n" for line in lines))}).json()["id"]
        batch_id = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"}).json()["id"]
        wait_until(lambda: http.get(f"/v1/batches/{batch_id}").json()["status"] == "completed", 120, poll_s=0.1)
        batch = http.get(f"/v1/batches/{batch_id}").json()
        output, errors = ([json.loads(line) for line in http.get(f"/v1/files/{batch[name]}/content").text.splitlines()]
                          for name in ("output_file_id", "error_file_id"))
    assert [o["custom_id"] for o in output] == ["picture"]
    expected = answer(daemon, question(png_bytes(40, 24)))
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == expected
    assert [e["custom_id"] for e in errors] == ["oversized"] and "--max-image-pixels" in json.dumps(errors)


def test_the_same_new_image_in_eight_concurrent_requests_is_encoded_once(daemon):
    import time

    from daemonkit import wait_until

    from cbatch.workers.decode.publisher import STATS_INTERVAL_S

    def num_encoded() -> int:
        with daemon.client() as client:
            return client.stats()["num_images_encoded"]

    before = num_encoded()
    image = png_bytes(36, 20, seed=77)  # sent by no other test
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: answer(daemon, question(image)), range(8)))
    assert len(set(answers)) == 1
    # The worker's stats lag its work by up to STATS_INTERVAL_S: the count reaches one more
    # and stays there for several such intervals.
    wait_until(lambda: num_encoded() > before, 30, poll_s=0.05)
    watched_until_s = time.monotonic() + 4 * STATS_INTERVAL_S
    while time.monotonic() < watched_until_s:
        assert num_encoded() == before + 1


def test_an_image_block_on_the_messages_api_is_the_chat_images(daemon):
    """Anthropic's base64 image block: the same answer as the same image in a chat image_url part."""
    image = png_bytes(40, 24, seed=5)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}
    body = {"model": daemon.health["model_names"][0], "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, block]}]}
    response = httpx.post(f"{daemon.base_url}/v1/messages", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["content"][0]["text"] == answer(daemon, question(image))
    assert response.json()["usage"]["input_tokens"] + response.json()["usage"]["cache_read_input_tokens"] > 16
