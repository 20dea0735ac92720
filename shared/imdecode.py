"""Decoding a checked JPEG or PNG for a model: what the edge agent and the verifier share.

``decode_rgb`` gives the image in RGB, the models' order, as small as it decodes while
it stays at least the model's input size:

- A JPEG is decoded by libjpeg-turbo through ``simplejpeg``, scaled inside the inverse
  DCT (by 1/8 steps: a 1920x1080 frame for a 320 px model decodes at 720x405), which
  skips most of the decode's work, and written in RGB by the decoder itself. Given an
  ``out`` of the image's size (a frame already at the model's size, into its slot of
  the batch), it decodes straight into it: no array of its own, no copy. The decode
  releases the interpreter lock once; OpenCV's takes it back in the middle of the call
  to allocate its output, and a thread that gives the lock up waits for it again
  whenever another holds it (the reference detector's 320 px frames, with a Python
  thread spinning beside: 787 against 1605 us a frame, 278 against 352 alone).
- A PNG is decoded by OpenCV, whole (PNG has no reduced decode), in RGB where OpenCV
  writes it (4.10 and later), else converted; so is a JPEG libjpeg-turbo refuses, since
  OpenCV's decoder skips what it can (stray bytes between segments, as some cameras
  write them); a JPEG that does not end with its EOI marker (truncated) is refused
  instead, whatever OpenCV would fill in.
- EXIF orientation is ignored either way: the pixels are the ones the camera stored.

None means the decoders refused the bytes (truncated or corrupt data, a colour space
they do not convert): the caller decodes them with Pillow, whose error says what is
wrong, or which reads what they would not.

Every JPEG libjpeg-turbo refuses is counted by what became of it
(``edgeloop_jpeg_fallback_decodes_total{outcome}`` on the agent's and the cloud's
``/metrics``: ``DecodeFallbackCollector``): ``opencv`` (decoded by OpenCV, at several
times the cost of a reduced decode), ``refused`` (OpenCV refused it too) or
``truncated``. A camera whose every frame goes to OpenCV shows there, and so does
the CPU it costs. The counts are the serving process's own: an image decoded in a
``shared.decode_pool`` worker process (a progressive or costly JPEG) is not counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import cv2
import numpy as np
import simplejpeg
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from shared.images import ImageInfo

__all__ = ["DecodeFallbackCollector", "decode_rgb", "fallback_decodes"]

_EOI = b"\xff\xd9"
_RGB: int | None = getattr(cv2, "IMREAD_COLOR_RGB", None)
# OpenCV's flag (a PNG, a JPEG libjpeg-turbo refused): colour, in RGB where it writes
# RGB (else BGR, converted after).
_OPENCV_FLAG = (_RGB if _RGB is not None else cv2.IMREAD_COLOR) | cv2.IMREAD_IGNORE_ORIENTATION


# JPEGs libjpeg-turbo refused in this process, by outcome (rare: a lock is cheap here).
_fallbacks = dict.fromkeys(("opencv", "refused", "truncated"), 0)
_fallbacks_lock = threading.Lock()


def _count_fallback(outcome: str) -> None:
    with _fallbacks_lock:
        _fallbacks[outcome] += 1


def fallback_decodes() -> dict[str, int]:
    """JPEGs libjpeg-turbo refused in this process so far, by outcome (module doc)."""
    with _fallbacks_lock:
        return dict(_fallbacks)


class DecodeFallbackCollector(Collector):
    """Exports :func:`fallback_decodes` at each scrape."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "edgeloop_jpeg_fallback_decodes",
            "JPEGs libjpeg-turbo refused, by outcome: decoded by OpenCV, refused by it too,"
            " truncated",
            labels=["outcome"],
        )
        for outcome, count in fallback_decodes().items():
            family.add_metric([outcome], count)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())


def decode_rgb(
    data: bytes, info: ImageInfo, size: tuple[int, int] | None, out: np.ndarray | None = None
) -> np.ndarray | None:
    """``data`` (checked: ``info`` is its ``probe_image``) in RGB, uint8 [H, W, 3], as
    small as it decodes while at least ``size`` (H, W; None: whole); written into ``out``
    (uint8 [H, W, 3], C-contiguous) when the image decodes at ``out``'s size, and then
    ``out`` is what it returns. None when the decoder refuses it (see the module doc)."""
    if info.format == "jpeg":
        try:
            if out is not None and out.shape[:2] == (info.height, info.width):
                simplejpeg.decode_jpeg(data, "RGB", buffer=out)
                return out
            h, w = size or (0, 0)
            return simplejpeg.decode_jpeg(data, "RGB", min_height=h, min_width=w)
        except ValueError:  # a defect, truncation, or a colour space it cannot convert
            if not data.rstrip(b"\x00").endswith(_EOI):
                _count_fallback("truncated")
                return None  # truncated: never a picture filled out with grey
            # Else OpenCV's decode, whole, which skips what it can (stray bytes).
            decoded = _opencv(data)
            _count_fallback("refused" if decoded is None else "opencv")
            return decoded
    return _opencv(data)


def _opencv(data: bytes) -> np.ndarray | None:
    decoded = cv2.imdecode(np.frombuffer(data, np.uint8), _OPENCV_FLAG)
    if decoded is None or _RGB is not None:
        return decoded
    return cv2.cvtColor(decoded, cv2.COLOR_BGR2RGB)
