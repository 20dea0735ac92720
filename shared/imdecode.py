"""The ``cv2.imdecode`` flag for an image headed to a model: what the edge agent and the
verifier both decode with.

- A JPEG at least 8, 4 or 2 times the model's input in both directions is decoded at
  1/8, 1/4 or 1/2 of its size by libjpeg itself (DCT scaling), which skips most of the
  inverse DCT, while the result stays at least the model's size.
- Colour images come out in RGB, the models' order, where OpenCV can (4.10 and later:
  libjpeg and libpng write RGB themselves), so no conversion runs after the decode:
  under load each extra OpenCV call is one more wait for the interpreter lock.
- EXIF orientation is ignored: the pixels are the ones the camera stored.
"""

from __future__ import annotations

import cv2

from shared.images import ImageInfo

__all__ = ["DECODES_RGB", "decode_flag"]

_REDUCED = (
    (8, cv2.IMREAD_REDUCED_COLOR_8),
    (4, cv2.IMREAD_REDUCED_COLOR_4),
    (2, cv2.IMREAD_REDUCED_COLOR_2),
)
_RGB: int | None = getattr(cv2, "IMREAD_COLOR_RGB", None)
# Whether ``decode_flag``'s images come out in RGB (else BGR, OpenCV's own order).
DECODES_RGB = _RGB is not None


def decode_flag(info: ImageInfo, size: tuple[int, int] | None, *, rgb: bool = True) -> int:
    """The flag that decodes ``info``'s image (a JPEG or PNG) in colour, reduced by
    libjpeg as far as it stays at least ``size`` (H, W; None: full size), in RGB where
    OpenCV can (``DECODES_RGB``) unless ``rgb`` is False (BGR, OpenCV's own order)."""
    flag = int(cv2.IMREAD_COLOR)
    if size is not None and info.format == "jpeg":
        h, w = size
        for factor, reduced in _REDUCED:
            if info.width >= factor * w and info.height >= factor * h:
                flag = int(reduced)
                break
    if rgb and _RGB is not None:
        flag = (flag & ~cv2.IMREAD_COLOR) | _RGB
    return flag | cv2.IMREAD_IGNORE_ORIENTATION
