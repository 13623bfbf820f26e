"""A request's image files checked against the daemon's bounds before anything decodes them.

The size an image decodes to is read from its header, so an image file of a few kilobytes
that would decode to gigabytes of pixels (a decompression bomb) is refused unread. Only the
formats llama.cpp's image reader (stb_image) decodes and this header reader knows are taken.
"""

import struct

from cbatch.config import EngineConfig
from cbatch.errors import INVALID_REQUEST, CbatchError

FORMATS = "PNG, JPEG, GIF or BMP"
# JPEG's start-of-frame markers (which carry the size): C0-CF but DHT (C4), JPG (C8) and DAC (CC).
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# JPEG markers that stand alone, with no length after them: TEM, RST0-7, SOI.
_JPEG_BARE = frozenset([0x01, *range(0xD0, 0xD9)])


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the file's header; None when it is none of FORMATS or is cut short."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
            return struct.unpack(">II", data[16:24])
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return struct.unpack("<HH", data[6:10])
        if data.startswith(b"BM"):
            width, height = struct.unpack("<ii", data[18:26])
            return abs(width), abs(height)  # a negative height is a top-down bitmap
        if data.startswith(b"\xff\xd8"):
            return _jpeg_size(data)
    except struct.error:  # cut short
        return None
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
        elif marker in _JPEG_BARE:
            i += 2
        elif marker in _JPEG_FRAMES:
            height, width = struct.unpack(">HH", data[i + 5:i + 9])
            return width, height
        else:
            i += 2 + struct.unpack(">H", data[i + 2:i + 4])[0]
    return None


def check_image_files(images: tuple[bytes, ...], config: EngineConfig) -> None:
    """Raises INVALID_REQUEST naming the image and the bound (the flag that sets it) it passes."""
    if len(images) > config.max_images:
        raise CbatchError(INVALID_REQUEST, f"images: {len(images)} images; this server takes at most "
                                           f"{config.max_images} per request (--max-images)")
    for i, data in enumerate(images):
        if len(data) > config.max_image_bytes:
            raise CbatchError(INVALID_REQUEST, f"images[{i}] is {len(data)} bytes; this server takes at most "
                                               f"{config.max_image_bytes} per image (--max-image-bytes)")
        size = image_size(data)
        if size is None:
            raise CbatchError(INVALID_REQUEST, f"images[{i}] is not a {FORMATS} file (or its header is cut short)")
        width, height = size
        if width * height > config.max_image_pixels:
            raise CbatchError(INVALID_REQUEST, f"images[{i}] is {width}x{height} pixels; this server takes at most "
                                               f"{config.max_image_pixels} pixels per image (--max-image-pixels)")
