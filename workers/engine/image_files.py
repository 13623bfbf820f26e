"""A request's image files checked against the daemon's bounds before anything decodes them.

The size an image decodes to is read from its header, so an image file of a few kilobytes
that would decode to gigabytes of pixels (a decompression bomb) is refused unread. Only the
formats llama.cpp's image reader (stb_image) decodes and this header reader knows are taken.

A PNG's pixel data is one zlib stream, which stb_image inflates whole into a buffer it grows
as it goes, whatever the header says: a 1x1 PNG whose stream inflates to gigabytes would
take them. So a PNG's stream is inflated here first, in bounded pieces that are counted and
dropped, and refused past the size its header makes it (height rows of a filter byte and
the row's bytes, per Adam7 pass when interlaced). GIF, BMP and JPEG decode into buffers
their headers size.
"""

import struct
import zlib

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


# A PNG colour type's channels: grey, RGB, palette index, grey + alpha, RGBA.
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
# Adam7's passes: (first column, first row, column step, row step).
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
INFLATE_PIECE_BYTES = 1 << 20  # the most inflated at once while a PNG's stream is counted


def png_raw_bytes(data: bytes) -> int | None:
    """The bytes a PNG's pixel stream inflates to by its header; None for a header stb_image
    would refuse anyway (an unknown colour type)."""
    try:
        width, height, bit_depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", data[16:29])
    except struct.error:  # cut short
        return None
    channels = _PNG_CHANNELS.get(colour_type)
    if channels is None:
        return None

    def rows(num_columns: int, num_rows: int) -> int:
        return num_rows * (1 + (num_columns * channels * bit_depth + 7) // 8) if num_columns else 0

    if not interlace:
        return rows(width, height)
    return sum(rows((width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy) for x0, y0, dx, dy in _ADAM7)


def png_inflates_within(data: bytes, max_bytes: int) -> bool:
    """Whether the PNG's IDAT stream inflates to at most max_bytes, holding at most
    INFLATE_PIECE_BYTES of it at once (a stream zlib refuses is counted up to where it
    fails: llama.cpp's reader then fails on it too, or only its checksum was wrong)."""
    inflater, num_bytes, at = zlib.decompressobj(), 0, 8
    try:
        while at + 8 <= len(data):
            length, kind = struct.unpack(">I4s", data[at:at + 8])
            if kind == b"IDAT":
                piece = data[at + 8:at + 8 + length]
                while piece and not inflater.eof:
                    num_bytes += len(inflater.decompress(piece, INFLATE_PIECE_BYTES))
                    if num_bytes > max_bytes:
                        return False
                    piece = inflater.unconsumed_tail
            at += 12 + length
    except zlib.error:  # corrupt, or only its checksum wrong (stb_image never checks it): what came out counts
        return num_bytes <= max_bytes
    return True


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
        if data.startswith(b"\x89PNG"):
            raw_bytes = png_raw_bytes(data)
            if raw_bytes is None or not png_inflates_within(data, raw_bytes):
                raise CbatchError(INVALID_REQUEST, f"images[{i}]: its PNG pixel data inflates to more than the "
                                                   f"{width}x{height} pixels its header says (or it names no PNG "
                                                   "colour type)")
