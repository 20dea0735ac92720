"""probe_image against PIL-encoded images, and against truncation and garbage."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from shared.errors import ImageFormatError
from shared.images import ImageInfo, probe_image

SIZES = [(1, 1), (7, 3), (3, 7), (64, 48), (640, 480), (1500, 2)]

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("PNG", "1", {}),
    ("PNG", "L", {}),
    ("PNG", "LA", {}),
    ("PNG", "P", {}),
    ("PNG", "RGB", {}),
    ("PNG", "RGBA", {}),
    ("PNG", "I;16", {}),
    ("PNG", "RGB", {"optimize": True}),
    ("JPEG", "L", {}),
    ("JPEG", "RGB", {"quality": 95, "subsampling": 0}),
    ("JPEG", "RGB", {"quality": 50, "subsampling": 2}),
    ("JPEG", "RGB", {"progressive": True}),
    ("JPEG", "RGB", {"progressive": True, "optimize": True}),
    ("JPEG", "CMYK", {}),
    ("JPEG", "RGB", {"exif": b"Exif\x00\x00" + b"\x00" * 64}),
    ("JPEG", "RGB", {"icc_profile": b"\x00" * 3000, "dpi": (72, 72)}),
]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize(
    ("fmt", "mode", "save"), CASES, ids=[f"{f}-{m}-{'-'.join(s) or 'plain'}" for f, m, s in CASES]
)
def test_probe_matches_pil(
    fmt: str,
    mode: str,
    save: dict[str, Any],
    size: tuple[int, int],
    encode_image: Callable[..., bytes],
) -> None:
    data = encode_image(size, mode, fmt, **save)
    expected = ImageInfo("png" if fmt == "PNG" else "jpeg", *size)
    assert probe_image(data) == expected
    with Image.open(io.BytesIO(data)) as reopened:
        assert reopened.size == size


def test_pixels() -> None:
    assert ImageInfo("png", 640, 480).pixels == 307_200


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_every_truncation_before_the_size_is_refused(
    fmt: str, encode_image: Callable[..., bytes]
) -> None:
    data = encode_image((33, 21), "RGB", fmt, exif=b"Exif\x00\x00" + b"\x00" * 40)
    needed = None
    for cut in range(len(data)):
        try:
            info = probe_image(data[:cut])
        except ImageFormatError:
            assert needed is None, f"a cut at {cut} failed after a shorter one succeeded"
            continue
        needed = needed if needed is not None else cut
        assert info == ImageInfo("png" if fmt == "PNG" else "jpeg", 33, 21)
    assert needed is not None and needed < len(data)


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "WEBP", "TIFF"])
def test_other_formats_are_refused(fmt: str, encode_image: Callable[..., bytes]) -> None:
    with pytest.raises(ImageFormatError, match="expected a JPEG or PNG image"):
        probe_image(encode_image((8, 8), "RGB", fmt))


def _png_with_ihdr(width: int, height: int, depth: int = 8, color: int = 2) -> bytes:
    body = b"IHDR" + struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + body + struct.pack(">I", zlib.crc32(body))


def test_png_header_checks() -> None:
    assert probe_image(_png_with_ihdr(5, 6)) == ImageInfo("png", 5, 6)
    for bad in (
        _png_with_ihdr(0, 6),
        _png_with_ihdr(5, 0),
        _png_with_ihdr(2**31, 1),
        _png_with_ihdr(5, 6, depth=3),
        _png_with_ihdr(5, 6, color=5),
    ):
        with pytest.raises(ImageFormatError):
            probe_image(bad)
    corrupted = bytearray(_png_with_ihdr(5, 6))
    corrupted[18] ^= 0x01  # width changed, CRC not updated
    with pytest.raises(ImageFormatError, match="CRC"):
        probe_image(bytes(corrupted))


def test_jpeg_header_checks() -> None:
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, 0, 16, 1) + b"\x01\x11\x00"
    with pytest.raises(ImageFormatError, match="unsupported size"):
        probe_image(b"\xff\xd8" + sof)  # height 0: given later by DNL
    with pytest.raises(ImageFormatError, match="before the frame"):
        probe_image(b"\xff\xd8\xff\xda\x00\x02")  # scan before any frame header
    with pytest.raises(ImageFormatError, match="invalid length"):
        probe_image(b"\xff\xd8\xff\xe0\x00\x01")
    with pytest.raises(ImageFormatError, match="truncated before its frame"):
        probe_image(b"\xff\xd8\x00\x00")  # no marker after the SOI at all
    # Bytes between segments are skipped to the next marker, as libjpeg skips them.
    sof_5x16 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, 5, 16, 1) + b"\x01\x11\x00"
    stray = b"\xff\xd8\xff\xe0\x00\x04\x00\x00\x12\x34" + sof_5x16
    assert probe_image(stray) == ImageInfo("jpeg", 16, 5)
    fill_and_restart = b"\xff\xd8\xff\xff\xd0" + b"\xff\xc2" + struct.pack(">HBHHB", 11, 8, 9, 7, 1)
    assert probe_image(fill_and_restart + b"\x01\x11\x00") == ImageInfo("jpeg", 7, 9)


@settings(max_examples=500, deadline=None, database=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.binary(max_size=200).map(lambda b: b"\xff\xd8" + b),
        st.binary(max_size=200).map(lambda b: b"\x89PNG\r\n\x1a\n" + b),
    )
)
def test_garbage_only_raises_image_format_error(data: bytes) -> None:
    try:
        info = probe_image(data)
    except ImageFormatError:
        return
    assert info.width > 0 and info.height > 0
