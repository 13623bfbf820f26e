"""Images in a request: where each goes, and the bounds every way in shares.

A request's `images` are image files' bytes (PNG, JPEG, GIF or BMP); each takes the place
of one IMAGE_MARKER in its prompt or messages, in order. The daemon decodes them and its
projector (cbatch-worker --mmproj) turns each into embeddings in the prompt
(workers/engine/vision.py); the daemon's --max-images and --max-image-bytes may only lower
the bounds here: an image travels as one msgpack bin, which the protocol bounds at 2 MiB.
"""

from cbatch.errors import INVALID_REQUEST, CbatchError

IMAGE_MARKER = "<__media__>"  # llama.cpp mtmd's own media marker
MAX_IMAGES = 64
MAX_IMAGE_BYTES = 2_000_000


def check_images(value, prompt, messages) -> tuple[bytes, ...]:
    """A request body's `images` (None: none), checked against the markers in its `prompt`
    or its messages' content."""
    if value is None or value == []:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(image, bytes) and image for image in value):
        raise CbatchError(INVALID_REQUEST, "images must be a list of image files' bytes (PNG or JPEG), none empty")
    if len(value) > MAX_IMAGES:
        raise CbatchError(INVALID_REQUEST, f"images: {len(value)} images; at most {MAX_IMAGES} per request")
    if any(len(image) > MAX_IMAGE_BYTES for image in value):
        raise CbatchError(INVALID_REQUEST, f"images: an image is larger than {MAX_IMAGE_BYTES} bytes")
    # Before the messages are checked (parse_request checks them next): skip what is malformed.
    messages = messages if isinstance(messages, (list, tuple)) else []
    texts = [prompt] if prompt is not None else [m.get("content") for m in messages if isinstance(m, dict)]
    num_markers = sum(text.count(IMAGE_MARKER) for text in texts if isinstance(text, str))
    if num_markers != len(value):
        raise CbatchError(INVALID_REQUEST, f"images: {len(value)} images but {num_markers} {IMAGE_MARKER} markers in "
                                           "the text; each image goes where one marker is, and the text holds no "
                                           "other marker")
    return tuple(value)
