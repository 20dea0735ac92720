"""The decode the agent and the verifier share: reduced by libjpeg-turbo, in RGB."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from prometheus_client import CollectorRegistry, generate_latest

from shared.images import probe_image
from shared.imdecode import DecodeFallbackCollector, decode_rgb, fallback_decodes


def _image(width: int, height: int, fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    """A smooth picture whose three channels differ, so a swapped order shows."""
    ys, xs = np.mgrid[0:height, 0:width]
    pixels = np.stack([xs * 255 // width, ys * 255 // height, np.full_like(xs, 40)], -1)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).convert(mode).save(buffer, format=fmt, quality=95)
    return buffer.getvalue()


def _pillow(data: bytes, size: tuple[int, int] | None = None) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        if size is not None:
            rgb = rgb.resize(size[::-1], Image.Resampling.BOX)
        return np.asarray(rgb).astype(int)


@pytest.mark.parametrize(
    ("size", "decoded_hw"),
    [
        ((1920, 1080), (405, 720)),  # 3/8: the smallest eighth still >= 320 both ways
        ((640, 480), (120, 160)),  # 1/4
        ((320, 240), (240, 320)),  # already within 2x of 224: whole
    ],
)
def test_a_jpeg_decodes_as_small_as_stays_at_least_the_model_size(
    size: tuple[int, int], decoded_hw: tuple[int, int]
) -> None:
    data = _image(*size)
    model_hw = {(1920, 1080): (320, 320), (640, 480): (64, 64), (320, 240): (224, 224)}[size]
    rgb = decode_rgb(data, probe_image(data), model_hw)
    assert rgb is not None and rgb.shape == (*decoded_hw, 3) and rgb.dtype == np.uint8
    # The same picture, in RGB order (blue, constant at 40, is last).
    assert np.abs(rgb.astype(int) - _pillow(data, decoded_hw)).mean() < 3
    assert abs(float(rgb[..., 2].mean()) - 40) < 2


@pytest.mark.parametrize(
    ("fmt", "mode"), [("JPEG", "RGB"), ("JPEG", "L"), ("PNG", "RGB"), ("PNG", "L")]
)
def test_whole_images_are_rgb_whatever_they_hold(fmt: str, mode: str) -> None:
    data = _image(96, 64, fmt, mode)
    rgb = decode_rgb(data, probe_image(data), None)
    assert rgb is not None and rgb.shape == (64, 96, 3)
    assert np.abs(rgb.astype(int) - _pillow(data)).max() <= (0 if fmt == "PNG" else 2)


def test_a_jpeg_at_the_outs_size_is_decoded_into_it_and_only_it() -> None:
    data = _image(64, 48)
    batch = np.zeros((3, 48, 64, 3), np.uint8)
    written = decode_rgb(data, probe_image(data), (48, 64), batch[1])
    assert written is not None and np.shares_memory(written, batch[1])
    alone = decode_rgb(data, probe_image(data), (48, 64))
    assert alone is not None and np.array_equal(batch[1], alone)
    assert not batch[0].any() and not batch[2].any()
    # Another size: decoded on its own, ``out`` untouched (the caller resizes into it).
    larger = _image(100, 75)
    other = decode_rgb(larger, probe_image(larger), (48, 64), batch[2])
    assert other is not None and other.shape == (57, 75, 3) and not batch[2].any()


def test_a_truncated_or_corrupt_jpeg_is_refused_for_the_caller_to_name() -> None:
    data = _image(320, 240)
    info = probe_image(data)
    assert decode_rgb(data[: len(data) // 2], info, (64, 64)) is None
    corrupt = data[:600] + bytes(len(data) - 600)
    assert decode_rgb(corrupt, info, (64, 64)) is None


def test_stray_bytes_between_segments_are_skipped_as_cameras_need() -> None:
    data = _image(64, 48)
    scan = data.index(b"\xff\xda")
    stray = data[:scan] + b"\x12\x34\x56" + data[scan:]  # "extraneous bytes before marker"
    rgb = decode_rgb(stray, probe_image(stray), None)
    clean = decode_rgb(data, probe_image(data), None)
    assert rgb is not None and clean is not None and np.array_equal(rgb, clean)


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in fallback_decodes().items() if v != before[k]}


def test_each_jpeg_libjpeg_turbo_refuses_is_counted_by_what_became_of_it() -> None:
    data = _image(64, 48)
    scan = data.index(b"\xff\xda")
    stray = data[:scan] + b"\x12\x34\x56" + data[scan:]
    before = fallback_decodes()
    decode_rgb(data, probe_image(data), None)
    assert _delta(before) == {}  # the usual path counts nothing
    assert decode_rgb(stray, probe_image(stray), None) is not None
    assert _delta(before) == {"opencv": 1}
    assert decode_rgb(data[: len(data) // 2], probe_image(data), None) is None
    assert _delta(before) == {"opencv": 1, "truncated": 1}
    whole_but_broken = data[:600] + b"\x00" * 50 + b"\xff\xd9"
    assert decode_rgb(whole_but_broken, probe_image(data), None) is None
    assert _delta(before) == {"opencv": 1, "truncated": 1, "refused": 1}


def test_the_counts_are_on_metrics_pages() -> None:
    data = _image(64, 48)
    scan = data.index(b"\xff\xda")
    stray = data[:scan] + b"\x12\x34\x56" + data[scan:]
    decode_rgb(stray, probe_image(stray), None)  # at least one count that is not zero
    registry = CollectorRegistry()
    registry.register(DecodeFallbackCollector())
    page = generate_latest(registry).decode()
    counts = fallback_decodes()
    assert counts["opencv"] >= 1
    for outcome, count in counts.items():
        assert f'edgeloop_jpeg_fallback_decodes_total{{outcome="{outcome}"}} {float(count)}' in page
