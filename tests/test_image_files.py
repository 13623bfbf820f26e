"""A PNG whose pixel stream inflates past what its header says (a zlib bomb: a 1x1 image
whose few hundred kilobytes inflate to a gigabyte) is refused before llama.cpp's reader,
which would inflate it whole, sees it; the check holds a bounded piece at a time."""

import resource
import zlib

import pytest
from imagekit import png_bomb, png_bytes, png_file

from cbatch.config import EngineConfig
from cbatch.errors import CbatchError
from cbatch.workers.engine.image_files import check_image_files, png_raw_bytes


def test_a_1x1_png_that_inflates_to_a_gigabyte_is_refused_holding_little():
    bomb = png_bomb(1, 1, 1 << 30)
    assert len(bomb) < EngineConfig.max_image_bytes
    peak_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CbatchError) as err:
        check_image_files((bomb,), EngineConfig())
    assert "inflates to more than the 1x1 pixels its header says" in err.value.message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before_kb < 64 * 1024


@pytest.mark.parametrize("interlace", [0, 1], ids=["plain", "adam7"])
def test_a_png_whose_stream_is_its_headers_size_passes_and_one_byte_more_does_not(interlace):
    width, height = 13, 7
    num_raw = png_raw_bytes(png_file(width, height, b"", interlace))
    check_image_files((png_file(width, height, zlib.compress(bytes(num_raw)), interlace),), EngineConfig())
    with pytest.raises(CbatchError):
        check_image_files((png_file(width, height, zlib.compress(bytes(num_raw + 1)), interlace),), EngineConfig())


def test_the_test_images_pass_and_adam7_adds_a_filter_byte_per_pass_row():
    check_image_files((png_bytes(40, 24),), EngineConfig())
    assert png_raw_bytes(png_file(1, 1, b"")) == 1 + 3
    # 8x8 RGB in seven passes: rows x (filter byte + row bytes), pass by pass.
    assert png_raw_bytes(png_file(8, 8, b"", interlace=1)) == sum(
        rows * (1 + 3 * cols) for cols, rows in ((1, 1), (1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 4)))


def test_a_png_whose_stream_has_a_wrong_checksum_passes_as_llama_cpps_reader_takes_it():
    width, height = 5, 3
    stream = bytearray(zlib.compress(bytes(png_raw_bytes(png_file(width, height, b"")))))
    stream[-1] ^= 0xFF  # the Adler-32 at the stream's end, which stb_image never checks
    check_image_files((png_file(width, height, bytes(stream)),), EngineConfig())

