"""Small test images made in pure Python: PNGs of any size (zlib, no image library), and
their data: URLs as OpenAI's image_url parts carry them."""

import base64
import struct
import zlib


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """An 8-bit RGB PNG whose pixels depend on `seed`: the same arguments, the same bytes."""
    rows = b"".join(b"\x00" + bytes((x * 7 + y * 13 + seed * 31 + channel * 5) % 256
                                    for x in range(width) for channel in range(3)) for y in range(height))
    return png_file(width, height, zlib.compress(rows))


def png_file(width: int, height: int, stream: bytes, interlace: int = 0) -> bytes:
    """An 8-bit RGB PNG of that header and that (compressed) pixel stream, whatever it holds."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, interlace)  # 8 bits, truecolour
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", stream) + chunk(b"IEND", b"")


def png_bomb(width: int, height: int, num_inflated: int) -> bytes:
    """A PNG whose pixel stream inflates to num_inflated zero bytes, whatever its header says."""
    compressor, piece = zlib.compressobj(9), bytes(1 << 20)
    parts = [compressor.compress(piece) for _ in range(num_inflated // len(piece))]
    return png_file(width, height, b"".join(parts) + compressor.compress(bytes(num_inflated % len(piece)))
                    + compressor.flush())


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes, mime: str = "image/png") -> dict:
    """An OpenAI chat content part holding the image."""
    return {"type": "image_url", "image_url": {"url": data_url(data, mime)}}
