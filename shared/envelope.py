"""The sample envelope: a small JSON header followed by the raw image bytes.

Wire format (all integers big-endian), one MQTT payload per sample:

    offset  size  field
    0       4     magic b"ELSE" (EdgeLoop Sample Envelope)
    4       1     format version, u8 = 1
    5       1     flags, u8 = 0 (reserved: any other value is refused)
    6       2     header length H, u16
    8       4     CRC-32 (zlib/PNG polynomial), u32, over bytes 12 .. end
    12      H     header: a SampleHeader as compact UTF-8 JSON (encode_message)
    12+H    ...   image: the JPEG or PNG bytes as captured, never base64

The image length is implied by the payload length and must equal the header's
``image_bytes``. ``decode_envelope`` checks the cheap things first (prefix,
limits, CRC) and parses JSON and image headers only after them; pixels are never
decoded here. Every refusal is a ContractError: EnvelopeError for the envelope
itself (an unknown format version or flags: ``EnvelopeError`` with reason
``unsupported_version`` or ``unsupported_flags``), MessageError for its header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from shared.checksum import crc32
from shared.errors import (
    BadMagicError,
    ChecksumError,
    EnvelopeError,
    ImageFormatError,
    LimitExceededError,
    TruncatedEnvelopeError,
)
from shared.images import ImageInfo, probe_image
from shared.messages import SampleHeader, decode_message, encode_message

__all__ = [
    "ENVELOPE_VERSION",
    "MAGIC",
    "PREFIX_SIZE",
    "Envelope",
    "EnvelopeLimits",
    "decode_envelope",
    "encode_envelope",
    "envelope_overhead",
    "peek_sample_id",
]

MAGIC = b"ELSE"
ENVELOPE_VERSION = 1
_PREFIX = struct.Struct(">4sBBHI")
PREFIX_SIZE = _PREFIX.size  # 12
_MAX_HEADER_FIELD = 0xFFFF  # what the u16 header length can say


@dataclass(frozen=True)
class EnvelopeLimits:
    """Size limits checked before anything is decoded (settings feed these)."""

    max_header_bytes: int = 4096
    max_image_bytes: int = 2_000_000
    max_pixels: int = 4_000_000


@dataclass(frozen=True)
class Envelope:
    """A decoded sample: its checked header and its image bytes."""

    header: SampleHeader
    image: bytes
    info: ImageInfo  # the image's format and size, as probed from its bytes


_DEFAULT_LIMITS = EnvelopeLimits()


def _too_large(what: str, limit: str, actual: int, allowed: int) -> LimitExceededError:
    return LimitExceededError(
        f"{what} is {actual}, over the limit of {allowed}",
        limit=limit,
        actual=actual,
        allowed=allowed,
    )


def _check_image(header: SampleHeader, info: ImageInfo, limits: EnvelopeLimits) -> None:
    """Check the probed image against the header and the pixel limit."""
    if info.format != header.image_format:
        raise ImageFormatError(
            f"header says {header.image_format} but the image bytes are {info.format}"
        )
    if info.pixels > limits.max_pixels:
        raise _too_large(
            f"image of {info.width}x{info.height} pixels: pixel count",
            "pixels",
            info.pixels,
            limits.max_pixels,
        )
    if (info.width, info.height) != (header.image_width, header.image_height):
        raise ImageFormatError(
            f"header says {header.image_width}x{header.image_height}"
            f" but the image is {info.width}x{info.height}"
        )


def encode_envelope(
    header: SampleHeader, image: bytes, limits: EnvelopeLimits = _DEFAULT_LIMITS
) -> bytes:
    """One envelope from a header and the image it describes; checks what the receiver will."""
    header_bytes = encode_message(header)
    allowed_header = min(limits.max_header_bytes, _MAX_HEADER_FIELD)
    if len(header_bytes) > allowed_header:
        raise _too_large("header size", "header_bytes", len(header_bytes), allowed_header)
    if len(image) > limits.max_image_bytes:
        raise _too_large("image size", "image_bytes", len(image), limits.max_image_bytes)
    if header.image_bytes != len(image):
        raise ImageFormatError(
            f"header says {header.image_bytes} image bytes but the image has {len(image)}"
        )
    _check_image(header, probe_image(image), limits)
    crc = crc32(image, crc32(header_bytes))
    prefix = _PREFIX.pack(MAGIC, ENVELOPE_VERSION, 0, len(header_bytes), crc)
    return b"".join((prefix, header_bytes, image))


def decode_envelope(
    data: bytes | bytearray | memoryview, limits: EnvelopeLimits = _DEFAULT_LIMITS
) -> Envelope:
    """Check and decode one envelope; raise EnvelopeError or MessageError if unfit."""
    view = memoryview(data).cast("B")
    total = len(view)
    if total < PREFIX_SIZE:
        raise TruncatedEnvelopeError(
            f"envelope of {total} bytes is shorter than its {PREFIX_SIZE}-byte prefix"
        )
    magic, version, flags, header_len, crc = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise BadMagicError(f"payload does not start with {MAGIC!r}: not a sample envelope")
    if version != ENVELOPE_VERSION:
        raise EnvelopeError(
            f"envelope format version {version} is not supported (this receiver reads"
            f" version {ENVELOPE_VERSION})",
            reason="unsupported_version",
        )
    if flags != 0:
        raise EnvelopeError(
            f"envelope flags 0x{flags:02x} are not supported (reserved, must be 0)",
            reason="unsupported_flags",
        )
    if header_len > limits.max_header_bytes:
        raise _too_large("header size", "header_bytes", header_len, limits.max_header_bytes)
    image_start = PREFIX_SIZE + header_len
    if total < image_start:
        raise TruncatedEnvelopeError(
            f"envelope of {total} bytes ends inside its {header_len}-byte header"
        )
    image_len = total - image_start
    if image_len > limits.max_image_bytes:
        raise _too_large("image size", "image_bytes", image_len, limits.max_image_bytes)
    if crc32(view[PREFIX_SIZE:]) != crc:
        raise ChecksumError("envelope CRC-32 does not match its contents (corrupted or cut)")
    header = decode_message(
        view[PREFIX_SIZE:image_start], SampleHeader, max_bytes=limits.max_header_bytes
    )
    if header.image_bytes != image_len:
        raise TruncatedEnvelopeError(
            f"header says {header.image_bytes} image bytes but the envelope carries {image_len}"
        )
    image = bytes(view[image_start:])
    info = probe_image(image)
    _check_image(header, info, limits)
    return Envelope(header=header, image=image, info=info)


def peek_sample_id(data: bytes | bytearray | memoryview) -> str:
    """The sample id an envelope's header names, read without checking anything else.

    For in-process stand-ins of the cloud (``edge-agent tune``, the bench), whose own
    work must stay out of the agent's figures; never for accepting a sample, which is
    ``decode_envelope``'s job. Raises EnvelopeError when there is no id to read.
    """
    view = memoryview(data).cast("B")
    try:
        _magic, _version, _flags, header_len, _crc = _PREFIX.unpack_from(view)
        header = json.loads(bytes(view[PREFIX_SIZE : PREFIX_SIZE + header_len]))
        return str(header["sample_id"])
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise EnvelopeError(f"no sample id to read in this envelope: {exc}") from exc


def envelope_overhead(header: SampleHeader) -> int:
    """Bytes an envelope adds to its image: the prefix plus the encoded header."""
    return PREFIX_SIZE + len(encode_message(header))
