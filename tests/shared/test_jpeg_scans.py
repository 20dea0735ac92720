"""The JPEG scan limit: normal JPEGs pass, a scan bomb is refused from its markers alone."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from shared.errors import EdgeLoopError, ImageFormatError, JpegScanLimitError
from shared.images import MAX_JPEG_SCANS, check_jpeg_scans
from tests.shared.jpeg_bomb import progressive_jpeg, scan_bomb


def _baseline_jpeg() -> bytes:
    pixels = np.random.default_rng(1).integers(0, 255, (48, 40, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def test_baseline_has_one_scan() -> None:
    assert check_jpeg_scans(_baseline_jpeg()) == 1


def test_progressive_has_its_usual_scans() -> None:
    assert check_jpeg_scans(progressive_jpeg()) == 10


def test_restart_markers_and_stuffing_are_not_scans() -> None:
    pixels = np.random.default_rng(2).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    # restart_marker_blocks puts RSTn markers in the entropy-coded data.
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=100, restart_marker_blocks=1)
    data = buffer.getvalue()
    assert b"\xff\xd0" in data and b"\xff\x00" in data
    assert check_jpeg_scans(data) == 1


def test_extraneous_bytes_before_a_marker_are_skipped_as_libjpeg_skips_them() -> None:
    data = _baseline_jpeg()
    scan = data.index(b"\xff\xda")
    assert check_jpeg_scans(data[:scan] + b"\x12\x34\x56" + data[scan:]) == 1
    bomb = scan_bomb(MAX_JPEG_SCANS + 1)
    scan = bomb.index(b"\xff\xda")
    with pytest.raises(JpegScanLimitError):  # stray bytes hide no scan
        check_jpeg_scans(bomb[:scan] + b"\x00\x12" + bomb[scan:])


def test_scan_bomb_is_refused() -> None:
    bomb = scan_bomb(MAX_JPEG_SCANS + 1)
    with pytest.raises(JpegScanLimitError) as refused:
        check_jpeg_scans(bomb)
    assert refused.value.reason == "jpeg_too_many_scans"
    assert check_jpeg_scans(scan_bomb(MAX_JPEG_SCANS)) == MAX_JPEG_SCANS


def test_limit_is_a_parameter() -> None:
    with pytest.raises(JpegScanLimitError):
        check_jpeg_scans(progressive_jpeg(), max_scans=9)


def test_not_a_jpeg_has_no_scans() -> None:
    assert check_jpeg_scans(b"\x89PNG\r\n\x1a\n") == 0
    assert check_jpeg_scans(b"") == 0


def test_malformed_stream_is_an_image_format_error() -> None:
    with pytest.raises(ImageFormatError):
        check_jpeg_scans(b"\xff\xd8\x00\x00")
    with pytest.raises(ImageFormatError):
        check_jpeg_scans(b"\xff\xd8\xff\xe0\x00\x01")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256), st.integers(0, 3))
def test_random_bytes_raise_only_the_projects_errors(tail: bytes, max_scans: int) -> None:
    for data in (b"\xff\xd8" + tail, tail):
        with contextlib.suppress(EdgeLoopError):
            check_jpeg_scans(data, max_scans=max_scans)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_jpegs_raise_only_the_projects_errors(data: st.DataObject) -> None:
    jpeg = bytearray(scan_bomb(12, size=16))
    for _ in range(data.draw(st.integers(1, 8))):
        jpeg[data.draw(st.integers(0, len(jpeg) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(jpeg)))
    with contextlib.suppress(EdgeLoopError):
        check_jpeg_scans(bytes(jpeg[:cut]), max_scans=8)
