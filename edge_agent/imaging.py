"""Turning uploads and camera frames into model input, and frames into upload bytes.

Limits are checked before any pixel is decoded: the byte count first, then the
format and dimensions that ``shared.probe_image`` reads from the header alone, so
a 100-megapixel bomb costs a few microseconds to refuse.

``decode_for_model`` is the upload hot path (``shared.imdecode``): libjpeg-turbo
decodes a JPEG (releasing the GIL, so decoding overlaps inference), scaled inside its
inverse DCT to the smallest eighth of its size still at least the model's input (far
cheaper than decoding every pixel and shrinking afterwards), straight to RGB; the
frame is then resized to the model's size, into its slot of the batch where the
inference thread decodes its own batch (``model_tensor``'s ``out``). Anything the
decoder refuses is decoded again by Pillow, whose error says what was wrong.

With a ``DecodePool`` (the agent has one while it runs), the images whose decode
cost the limits do not bound (progressive JPEGs, many scans) are decoded in its
worker processes instead, within its time budget: one that runs past it is
refused with 422 and reason ``image_decode_timeout`` while the other frames are
answered.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import cv2
import numpy as np
from PIL import Image

from shared.decode_pool import DecodePool, Decoder
from shared.errors import (
    ImageDecodeFailedError,
    ImageDecodeTimeoutError,
    ImageError,
    ImageFormatError,
    JpegScanLimitError,
)
from shared.images import DecodeCost, ImageInfo, decode_cost, probe_image
from shared.imdecode import decode_rgb
from shared.interpreter import ProcessSetting

__all__ = [
    "ACCEPTED",
    "DecodedImage",
    "ImageRejected",
    "ModelFrame",
    "check_upload",
    "check_upload_cost",
    "decode_for_model",
    "decode_image",
    "encode_for_upload",
    "model_tensor",
    "opencv_threads",
    "prepare_bgr",
    "resize_for_model",
]

ACCEPTED = "a JPEG or PNG image as the request body (Content-Type image/jpeg or image/png)"
ACCEPTED_CONTENT_TYPES = ("image/jpeg", "image/png")


def opencv_threads(count: int) -> ProcessSetting[int]:
    """OpenCV's own threads inside one call (a colour conversion, a resize) at ``count``
    while applied, as the agent runs (0: OpenCV's default, one per core, left alone).

    The agent decodes and prepares frames on threads of its own, one per core; OpenCV
    splitting each call over its pool as well only adds hand-offs. Measured on the
    reference detector behind HTTP (2 cores, three alternating pairs): OpenCV's pool
    thread took 59-62 us of CPU per frame, and the agent 2.11-2.14 ms per frame with
    one thread against 2.31-2.51 with OpenCV's default, where two pairs of three agreed.
    """
    return ProcessSetting(count, read=cv2.getNumThreads, write=cv2.setNumThreads)


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


@dataclass(frozen=True)
class ModelFrame:
    """An upload ready for the model: the RGB tensor at the model's size, and the bytes."""

    tensor: np.ndarray  # uint8 [h, w, 3], the model's input size
    info: ImageInfo
    encoded: bytes


def check_upload(data: bytes, *, max_bytes: int, max_pixels: int) -> ImageInfo:
    """The limits, from the byte count and the header alone; raise ImageRejected when over."""
    return _check(data, max_bytes=max_bytes, max_pixels=max_pixels)[0]


def check_upload_cost(
    data: bytes, *, max_bytes: int, max_pixels: int
) -> tuple[ImageInfo, DecodeCost]:
    """``check_upload``, with what decoding it costs (``DecodePool.isolates`` reads it)."""
    return _check(data, max_bytes=max_bytes, max_pixels=max_pixels)


def _check(data: bytes, *, max_bytes: int, max_pixels: int) -> tuple[ImageInfo, DecodeCost]:
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
        cost = decode_cost(data, info)
    except JpegScanLimitError as exc:
        raise ImageRejected(
            f"{exc}; send {ACCEPTED}, baseline or progressive with at most the usual scans",
            reason=exc.reason,
            status=422,
        ) from exc
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
    return info, cost


def decode_image(
    data: bytes, *, max_bytes: int, max_pixels: int, pool: DecodePool | None = None
) -> DecodedImage:
    """Check limits, then decode a JPEG or PNG to RGB; raise ImageRejected with what is accepted.

    With a ``pool``, the images it isolates (progressive JPEGs, costly ones) are decoded
    in its worker processes, within its time budget.
    """
    info, cost = _check(data, max_bytes=max_bytes, max_pixels=max_pixels)
    if pool is not None and pool.isolates(cost):
        rgb = _isolated(pool, _decode_rgb, data, info)
    else:
        rgb = _decode_rgb(data, info)
    return DecodedImage(rgb=rgb, info=info, encoded=data)


def _decode_rgb(data: bytes, info: ImageInfo) -> np.ndarray:
    """Decode a checked JPEG or PNG to RGB with Pillow (whose errors say what is wrong)."""
    try:
        with warnings.catch_warnings():
            # PIL warns (and our test config turns warnings into errors) on odd metadata.
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as image:
                image.load()  # raises OSError on a truncated JPEG/PNG
                return np.asarray(image.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ImageRejected(
            f"the {info.format.upper()} image could not be decoded ({exc}); send {ACCEPTED}",
            reason="truncated" if "truncated" in str(exc) else "undecodable",
        ) from exc


def _isolated(pool: DecodePool, decoder: Decoder, data: bytes, *args: object) -> np.ndarray:
    """``decoder(data, *args)`` in the pool; its refusals as ImageRejected (422 past the budget)."""
    try:
        return pool.run(decoder, data, *args)
    except (ImageDecodeTimeoutError, ImageDecodeFailedError) as exc:
        raise ImageRejected(
            f"{exc}; send {ACCEPTED} that decodes in the usual time",
            reason=exc.reason,
            status=422,
        ) from exc
    except ImageError as exc:  # the decoder's own refusal, from its worker process
        raise ImageRejected(exc.message, reason=exc.reason) from exc


def decode_for_model(
    data: bytes,
    hw: tuple[int, int],
    *,
    max_bytes: int,
    max_pixels: int,
    pool: DecodePool | None = None,
) -> ModelFrame:
    """Check limits, decode and resize a JPEG or PNG to the model's RGB input.

    The one decode path for uploads, shared by the agent and its benchmark baseline.
    With a ``pool``, the images it isolates are decoded there, within its time budget.
    """
    info, cost = _check(data, max_bytes=max_bytes, max_pixels=max_pixels)
    if pool is not None and pool.isolates(cost):
        return ModelFrame(_isolated(pool, model_tensor, data, info, hw), info, data)
    return ModelFrame(model_tensor(data, info, hw), info, data)


def model_tensor(
    data: bytes, info: ImageInfo, hw: tuple[int, int], out: np.ndarray | None = None
) -> np.ndarray:
    """Decode a checked JPEG or PNG (``check_upload``) straight to the model's RGB input,
    written into ``out`` (uint8 [h, w, 3], a slot of the batch) when given."""
    decoded = decode_rgb(data, info, hw, out)
    if out is not None and decoded is out:  # decoded into it: at the model's size
        return out
    if decoded is None:
        # The decoder refused it: Pillow's decoder names the problem (or reads it).
        decoded = _decode_rgb(data, info)
    return resize_for_model(decoded, hw, out)


def prepare_bgr(bgr: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """A BGR frame as OpenCV decodes or captures it -> the model's RGB input.

    Shrunk first, then converted: the same pixels as converting first, for less work.
    """
    small = resize_for_model(bgr, hw)
    return cv2.cvtColor(small, cv2.COLOR_BGR2RGB, dst=np.empty_like(small))


def resize_for_model(
    rgb: np.ndarray, hw: tuple[int, int], out: np.ndarray | None = None
) -> np.ndarray:
    """[H, W, 3] -> uint8 [h, w, 3] at the model's size (area filter when shrinking),
    written into ``out`` when given (a slot of the batch: no array of its own to stack).

    A frame at least four times the model's size in both directions is first halved,
    as often as that still holds and its sides are even, by OpenCV's 2x2 box filter
    (exact, and fast); one general area resize, at least 2:1, does the rest. That is
    a fraction of the cost of one general area resize from a camera-sized frame, for
    pixels within a grey level or so of it (``python -m bench.agent`` reports both,
    and the difference, for common camera resolutions).
    """
    h, w = hw
    height, width = rgb.shape[:2]
    if height == h and width == w:
        if out is None:
            return np.ascontiguousarray(rgb, dtype=np.uint8)
        np.copyto(out, rgb, casting="unsafe")
        return out
    # Exact halves only (even sides), so each halving averages whole 2x2 blocks; at
    # least 4:1 before each, so the last resize still averages 2x2 halved pixels or more.
    while height >= 4 * h and width >= 4 * w and height % 2 == 0 and width % 2 == 0:
        height, width = height // 2, width // 2
        rgb = cv2.resize(
            rgb, (width, height), dst=_empty(rgb, height, width), interpolation=cv2.INTER_AREA
        )
    if height == h and width == w:
        if out is None:
            return rgb
        np.copyto(out, rgb)
        return out
    shrinking = height > h or width > w
    interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
    dst = _empty(rgb, h, w) if out is None else out
    return cv2.resize(rgb, (w, h), dst=dst, interpolation=interpolation)


def _empty(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """An output array for OpenCV, allocated here: OpenCV allocates the arrays it returns
    through numpy, which takes the interpreter lock in the middle of the call, a wait
    whenever another thread holds it; with the output given, it takes it only after."""
    return np.empty((height, width, *image.shape[2:]), image.dtype)


def encode_for_upload(
    pixels: np.ndarray,
    *,
    original: bytes | None,
    original_info: ImageInfo | None,
    max_side: int,
    quality: int,
    recompress: bool,
    bgr: bool = False,
) -> tuple[bytes, ImageInfo]:
    """The bytes forwarded to the cloud: the original when small enough, else downscaled JPEG.

    ``pixels`` are RGB, or BGR as OpenCV captures them when ``bgr`` (encoded as they
    are, with no conversion either way).
    """
    height, width = pixels.shape[:2]
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
        pixels = cv2.resize(pixels, size, interpolation=cv2.INTER_AREA)
    if not bgr:
        pixels = cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR)  # what imencode expects
    ok, buffer = cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:  # pragma: no cover - OpenCV only fails here on an empty image
        raise ImageError("could not JPEG-encode the frame for upload")
    data = buffer.tobytes()
    return data, ImageInfo("jpeg", pixels.shape[1], pixels.shape[0])
