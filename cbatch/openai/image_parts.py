"""OpenAI chat `image_url` content parts made into cbatch's `images` and their markers.

An image comes as a `data:` URL holding the file in base64 (PNG, JPEG, GIF or BMP; the
daemon decodes it and says when it cannot). An http(s) URL is refused: a server that
fetched what callers name would let them reach whatever its network reaches (SSRF).
"""

import base64
import binascii

from cbatch.images import IMAGE_MARKER, MAX_IMAGE_BYTES
from cbatch.params import invalid


def take_images(messages) -> tuple[object, list[bytes]]:
    """(the messages with each image part replaced by a text part holding IMAGE_MARKER,
    the images' bytes in order). Messages that are not a list are left for the chat's
    checks to refuse."""
    if not isinstance(messages, list):
        return messages, []
    images, converted = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(part) for part in content):
            converted.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if _is_image(part):
                images.append(_image_of(f"messages[{i}].content[{j}].image_url", part.get("image_url")))
                part = {"type": "text", "text": IMAGE_MARKER}
            parts.append(part)
        converted.append({**message, "content": parts})
    return converted, images


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _image_of(where: str, image_url) -> bytes:
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise invalid(f"{where} must be {{url: 'data:image/png;base64,...'}}")
    if url.startswith(("http://", "https://")):
        raise invalid(f"{where}: this server does not fetch image URLs (a server that fetches what callers name "
                      "reaches its own network for them); send the image inline as a data: URL "
                      "(data:image/png;base64,...)")
    head, comma, payload = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64") or not comma:
        raise invalid(f"{where}.url must be a data: URL of a base64 image (data:image/png;base64,...)")
    if len(payload) // 4 * 3 > MAX_IMAGE_BYTES + 3:
        raise invalid(f"{where}: the image is about {len(payload) // 4 * 3} bytes; at most {MAX_IMAGE_BYTES}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}.url: its data is not valid base64") from None
