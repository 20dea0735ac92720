"""Image format and size from the first bytes of a JPEG or PNG, without decoding pixels.

Used to check an envelope's image against its header and its pixel limit before
anything expensive runs. PNG: the signature and the IHDR chunk (CRC checked).
JPEG: the marker segments up to the first SOFn (baseline, extended, progressive,
lossless, arithmetic), skipping APPn/DQT/DHT/... segments by their lengths. Bytes
between one segment and the next marker are skipped, as libjpeg skips them
("extraneous bytes before marker", which some cameras write): such a JPEG is
checked like any other, and decoded by OpenCV (``shared.imdecode``).

``check_jpeg_scans`` walks the whole JPEG marker stream (segments by their lengths,
entropy-coded data up to the next marker that is neither a stuffed ``FF00`` nor an
RSTn, extraneous bytes up to the next marker) and refuses one with more than
``max_scans`` scans before a decoder sees it:
each progressive scan re-walks every block of the image, so 100k tiny scans in
2 MB make a decoder spin for minutes. A baseline JPEG has one scan, libjpeg's
progressive script ten.

``decode_cost`` says which images are decoded in a worker process with a time
budget (``shared.decode_pool``) and which in-process. A baseline JPEG or a PNG
costs about one pass over its pixels, so the pixel limit bounds its decode and it
is decoded in-process, where it is cheapest. A progressive JPEG (SOF2/6/10/14) is
re-walked by every scan and libjpeg keeps every coefficient of the image while it
does; its cost is not bounded by the pixel limit, so it always goes to the pool,
as does any image whose pixels times scans is over the caller's ``max_cost``
(a baseline JPEG split into many scans).
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass
from typing import Literal

from shared.errors import ImageFormatError, JpegScanLimitError

__all__ = [
    "DEFAULT_ISOLATE_COST",
    "MAX_JPEG_SCANS",
    "DecodeCost",
    "ImageFormat",
    "ImageInfo",
    "check_jpeg_scans",
    "decode_cost",
    "probe_image",
]

ImageFormat = Literal["jpeg", "png"]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_MAX_DIMENSION = 2**31 - 1
_PNG_BIT_DEPTHS = {0: {1, 2, 4, 8, 16}, 2: {8, 16}, 3: {1, 2, 4, 8}, 4: {8, 16}, 6: {8, 16}}
# Start-of-frame markers: C0-CF except C4 (DHT), C8 (JPG extension), CC (DAC).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers that stand alone, without a length: TEM and RST0-RST7.
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
# In entropy-coded data: an FF that starts a marker (not FF00 stuffing, RSTn or a fill FF).
_JPEG_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_JPEG_SOS = 0xDA
_JPEG_EOI = 0xD9
# Progressive start-of-frame markers (Huffman and arithmetic, sequential and differential).
_JPEG_PROGRESSIVE_SOF = frozenset({0xC2, 0xC6, 0xCA, 0xCE})
MAX_JPEG_SCANS = 64
# Pixels times scans above which even a baseline image goes to the decode pool: four
# passes over an image at the default pixel limit.
DEFAULT_ISOLATE_COST = 16_000_000


@dataclass(frozen=True)
class ImageInfo:
    """Format and dimensions of an encoded image."""

    format: ImageFormat
    width: int
    height: int

    @property
    def pixels(self) -> int:
        """Number of pixels (width times height)."""
        return self.width * self.height


@dataclass(frozen=True)
class DecodeCost:
    """What decoding an image costs, estimated from its markers: its pixels times its scans."""

    pixels: int
    scans: int
    progressive: bool

    @property
    def units(self) -> int:
        """Pixels times scans (one scan for a PNG)."""
        return self.pixels * max(1, self.scans)

    def isolate(self, max_cost: int) -> bool:
        """Whether to decode in a budgeted worker process: progressive, or over ``max_cost``."""
        return self.progressive or self.units > max_cost


def decode_cost(data: bytes, info: ImageInfo, *, max_scans: int = MAX_JPEG_SCANS) -> DecodeCost:
    """The decode cost of a probed image; JpegScanLimitError past ``max_scans`` scans."""
    if info.format != "jpeg":
        return DecodeCost(info.pixels, 1, False)
    scans, progressive = _walk_jpeg(data, max_scans)
    return DecodeCost(info.pixels, scans, progressive)


def probe_image(data: bytes) -> ImageInfo:
    """Return the format and size of a JPEG or PNG image, or raise ImageFormatError."""
    view = memoryview(data)
    if view[:8] == _PNG_SIGNATURE:
        return _probe_png(view)
    if view[:2] == b"\xff\xd8":
        return _probe_jpeg(data, view)
    raise ImageFormatError("expected a JPEG or PNG image: the bytes start with neither signature")


def _probe_png(view: memoryview) -> ImageInfo:
    if len(view) < 33:
        raise ImageFormatError("PNG image truncated before the end of its IHDR chunk")
    length, chunk_type = struct.unpack_from(">I4s", view, 8)
    if chunk_type != b"IHDR" or length != 13:
        raise ImageFormatError("PNG image does not start with a valid IHDR chunk")
    (crc,) = struct.unpack_from(">I", view, 29)
    if zlib.crc32(view[12:29]) != crc:
        raise ImageFormatError("PNG IHDR chunk fails its CRC")
    width, height, depth, color = struct.unpack_from(">IIBB", view, 16)
    if not (0 < width <= _PNG_MAX_DIMENSION and 0 < height <= _PNG_MAX_DIMENSION):
        raise ImageFormatError(f"PNG image has an invalid size {width}x{height}")
    if depth not in _PNG_BIT_DEPTHS.get(color, set()):
        raise ImageFormatError(f"PNG image has an invalid color type {color}/bit depth {depth}")
    return ImageInfo("png", width, height)


def _probe_jpeg(data: bytes, view: memoryview) -> ImageInfo:
    pos = 2
    end = len(view)
    while True:
        if pos < end and view[pos] != 0xFF:
            pos = data.find(b"\xff", pos)  # extraneous bytes before the marker: skipped
            if pos < 0:
                pos = end
        if pos >= end:
            raise ImageFormatError("JPEG image truncated before its frame (SOF) marker")
        while pos < end and view[pos] == 0xFF:  # any number of fill bytes
            pos += 1
        if pos >= end:
            raise ImageFormatError("JPEG image truncated before its frame (SOF) marker")
        marker = view[pos]
        pos += 1
        if marker in _JPEG_STANDALONE:
            continue
        if marker in (0x00, 0xD8, 0xD9, 0xDA):
            # Stuffed zero, a second SOI, EOI or scan data before any frame header.
            raise ImageFormatError(
                f"JPEG image is malformed: marker 0x{marker:02X} before the frame (SOF) marker"
            )
        if pos + 2 > end:
            raise ImageFormatError("JPEG image truncated inside a marker segment")
        (length,) = struct.unpack_from(">H", view, pos)
        if length < 2:
            raise ImageFormatError(f"JPEG marker 0x{marker:02X} has an invalid length {length}")
        if marker in _JPEG_SOF:
            if length < 8 or pos + 7 > end:
                raise ImageFormatError("JPEG image truncated inside its frame (SOF) header")
            height, width = struct.unpack_from(">HH", view, pos + 3)
            if width == 0 or height == 0:
                # Height 0 means "given later by a DNL marker"; cameras don't write that.
                raise ImageFormatError(f"JPEG image has an unsupported size {width}x{height}")
            return ImageInfo("jpeg", width, height)
        pos += length


def check_jpeg_scans(data: bytes, *, max_scans: int = MAX_JPEG_SCANS) -> int:
    """The number of scans of a JPEG; raise JpegScanLimitError past ``max_scans``.

    Reads markers only (microseconds per scan, and it stops at ``max_scans + 1``);
    bytes that are not a JPEG return 0, a malformed marker stream raises
    ImageFormatError. A stream cut short returns the scans seen: the decoder
    refuses the truncation itself.
    """
    return _walk_jpeg(data, max_scans)[0]


def _walk_jpeg(data: bytes, max_scans: int) -> tuple[int, bool]:
    """(scans, whether the frame is progressive) of a JPEG; (0, False) for other bytes."""
    view = memoryview(data)
    if view[:2] != b"\xff\xd8":
        return 0, False
    pos, end, scans, progressive = 2, len(view), 0, False
    while pos < end:
        if view[pos] != 0xFF:  # extraneous bytes before the next marker: skipped
            skipped_to = data.find(b"\xff", pos)
            if skipped_to < 0:
                raise ImageFormatError(f"JPEG image is malformed: no marker after byte {pos}")
            pos = skipped_to
        while pos < end and view[pos] == 0xFF:  # any number of fill bytes
            pos += 1
        if pos >= end:
            break
        marker = view[pos]
        pos += 1
        if marker == _JPEG_EOI:
            break
        if marker in _JPEG_STANDALONE:
            continue
        if marker in (0x00, 0xD8):
            raise ImageFormatError(f"JPEG image is malformed: marker 0x{marker:02X} at {pos - 1}")
        if pos + 2 > end:
            break
        (length,) = struct.unpack_from(">H", view, pos)
        if length < 2:
            raise ImageFormatError(f"JPEG marker 0x{marker:02X} has an invalid length {length}")
        pos += length
        if marker in _JPEG_PROGRESSIVE_SOF:
            progressive = True
        if marker == _JPEG_SOS:
            scans += 1
            if scans > max_scans:
                raise JpegScanLimitError(
                    f"JPEG image has more than {max_scans} scans (a baseline JPEG has 1,"
                    f" a progressive one about 10)"
                )
            found = _JPEG_NEXT_MARKER.search(data, pos)
            if found is None:
                break
            pos = found.start()
    return scans, progressive
