"""Turning uploads and camera frames into model input, and frames into upload bytes.

Limits are checked before any pixel is decoded: the byte count first, then the
format and dimensions that ``shared.probe_image`` reads from the header alone, so
a 100-megapixel bomb costs a few microseconds to refuse.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import cv2
import numpy as np
from PIL import Image

from shared.errors import ImageError, ImageFormatError
from shared.images import ImageInfo, probe_image

__all__ = [
    "ACCEPTED",
    "DecodedImage",
    "ImageRejected",
    "decode_image",
    "encode_for_upload",
    "resize_for_model",
]

ACCEPTED = "a JPEG or PNG image as the request body (Content-Type image/jpeg or image/png)"
ACCEPTED_CONTENT_TYPES = ("image/jpeg", "image/png")


class ImageRejected(ImageError):
    """An upload the agent refuses; ``status`` is the HTTP status it maps to."""

    def __init__(self, message: str, *, reason: str, status: int = 400) -> None:
        super().__init__(message, reason=reason)
        self.status = status


@dataclass(frozen=True)
class DecodedImage:
    """An upload, decoded: RGB pixels and the bytes as received."""

    rgb: np.ndarray  # uint8 [H, W, 3]
    info: ImageInfo
    encoded: bytes


def decode_image(data: bytes, *, max_bytes: int, max_pixels: int) -> DecodedImage:
    """Check limits, then decode a JPEG or PNG to RGB; raise ImageRejected with what is accepted."""
    if not data:
        raise ImageRejected(f"the request body is empty: send {ACCEPTED}", reason="empty")
    if len(data) > max_bytes:
        raise ImageRejected(
            f"image of {len(data)} bytes is over the limit of {max_bytes} bytes",
            reason="too_large",
            status=413,
        )
    try:
        info = probe_image(data)
    except ImageFormatError as exc:
        raise ImageRejected(
            f"not an image the agent accepts ({exc}); send {ACCEPTED}", reason="not_image"
        ) from exc
    if info.pixels > max_pixels:
        raise ImageRejected(
            f"image of {info.width}x{info.height} = {info.pixels} pixels is over the limit of"
            f" {max_pixels} pixels",
            reason="too_many_pixels",
            status=413,
        )
    try:
        with warnings.catch_warnings():
            # PIL warns (and our test config turns warnings into errors) on odd metadata.
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as image:
                image.load()  # raises OSError on a truncated JPEG/PNG
                rgb = np.asarray(image.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ImageRejected(
            f"the {info.format.upper()} image could not be decoded ({exc}); send {ACCEPTED}",
            reason="truncated" if "truncated" in str(exc) else "undecodable",
        ) from exc
    return DecodedImage(rgb=rgb, info=info, encoded=data)


def resize_for_model(rgb: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """RGB [H, W, 3] -> uint8 [h, w, 3] at the model's size (area filter when shrinking)."""
    h, w = hw
    if rgb.shape[0] == h and rgb.shape[1] == w:
        return np.ascontiguousarray(rgb, dtype=np.uint8)
    shrinking = rgb.shape[0] > h or rgb.shape[1] > w
    interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
    return cv2.resize(rgb, (w, h), interpolation=interpolation)


def encode_for_upload(
    rgb: np.ndarray,
    *,
    original: bytes | None,
    original_info: ImageInfo | None,
    max_side: int,
    quality: int,
    recompress: bool,
) -> tuple[bytes, ImageInfo]:
    """The bytes forwarded to the cloud: the original when small enough, else downscaled JPEG."""
    height, width = rgb.shape[:2]
    if (
        original is not None
        and original_info is not None
        and not recompress
        and max(width, height) <= max_side
    ):
        return original, original_info
    scale = min(1.0, max_side / max(width, height))
    if scale < 1.0:
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        rgb = cv2.resize(rgb, size, interpolation=cv2.INTER_AREA)
    ok, buffer = cv2.imencode(
        ".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality]
    )
    if not ok:  # pragma: no cover - OpenCV only fails here on an empty image
        raise ImageError("could not JPEG-encode the frame for upload")
    data = buffer.tobytes()
    return data, ImageInfo("jpeg", rgb.shape[1], rgb.shape[0])
