"""The decode flag the agent and the verifier share: reduced by libjpeg, in RGB."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image

from shared.images import ImageInfo, probe_image
from shared.imdecode import DECODES_RGB, decode_flag


def _image(width: int, height: int, fmt: str) -> bytes:
    """A smooth picture whose three channels differ, so a swapped order shows."""
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.stack([xs * 255 // width, ys * 255 // height, np.full_like(xs, 40)], -1)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format=fmt, quality=95)
    return buffer.getvalue()


def _decode(data: bytes, flag: int) -> np.ndarray:
    decoded = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
    assert decoded is not None
    return decoded


@pytest.mark.parametrize(
    ("size", "decoded_hw"),
    [
        ((1024, 768), (96, 128)),  # 1/8: still at least 64 px both ways
        ((640, 480), (120, 160)),  # 1/4 (1/8 would be 60 px high)
        ((320, 240), (120, 160)),  # 1/2
        ((120, 200), (200, 120)),  # too small to reduce
    ],
)
def test_a_jpeg_is_decoded_as_small_as_stays_at_least_the_model_size(
    size: tuple[int, int], decoded_hw: tuple[int, int]
) -> None:
    data = _image(*size, "JPEG")
    assert _decode(data, decode_flag(probe_image(data), (64, 64))).shape == (*decoded_hw, 3)


def test_a_png_and_a_frame_for_no_model_size_are_decoded_whole() -> None:
    png = _image(640, 480, "PNG")
    assert _decode(png, decode_flag(probe_image(png), (64, 64))).shape == (480, 640, 3)
    jpeg = _image(640, 480, "JPEG")
    assert _decode(jpeg, decode_flag(probe_image(jpeg), None)).shape == (480, 640, 3)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_the_pixels_are_rgb_and_those_of_a_bgr_decode_converted(fmt: str) -> None:
    data = _image(320, 240, fmt)
    info = probe_image(data)
    rgb = _decode(data, decode_flag(info, (64, 64)))
    bgr = _decode(data, decode_flag(info, (64, 64), rgb=False))
    if DECODES_RGB:
        assert np.array_equal(rgb, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
        assert abs(float(rgb[..., 2].mean()) - 40) < 2  # blue, constant, is last
    else:  # an OpenCV before 4.10: BGR either way, converted by the caller
        assert np.array_equal(rgb, bgr)


def test_exif_orientation_is_ignored() -> None:
    flag = decode_flag(ImageInfo("jpeg", 64, 64), (64, 64))
    assert flag & cv2.IMREAD_IGNORE_ORIENTATION
