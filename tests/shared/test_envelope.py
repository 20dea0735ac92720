"""Sample envelopes: layout, round trips, overhead, and every way of refusing one."""

from __future__ import annotations

import io
import json
import math
import random
import struct
import zlib
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from shared.envelope import (
    MAGIC,
    PREFIX_SIZE,
    Envelope,
    EnvelopeLimits,
    decode_envelope,
    encode_envelope,
    envelope_overhead,
    peek_sample_id,
)
from shared.errors import (
    BadMagicError,
    ChecksumError,
    ContractError,
    EnvelopeError,
    ImageFormatError,
    LimitExceededError,
    MessageValidationError,
    TruncatedEnvelopeError,
    UnknownSchemaError,
    UnsupportedVersionError,
)
from shared.ids import new_sample_id
from shared.images import probe_image
from shared.messages import SampleHeader, encode_message

HeaderFactory = Callable[..., SampleHeader]


def raw_envelope(header: bytes, image: bytes, *, version: int = 1, flags: int = 0) -> bytes:
    """An envelope with a correct CRC around whatever header and image bytes are given."""
    crc = zlib.crc32(header + image)
    return struct.pack(">4sBBHI", MAGIC, version, flags, len(header), crc) + header + image


def typical_header() -> SampleHeader:
    """A low-confidence frame from a 10-class student, every field filled as an agent would."""
    rng = random.Random(7)
    logits = [rng.gauss(0.0, 2.0) for _ in range(10)]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    scores = [w / sum(weights) for w in weights]
    predicted = max(range(10), key=scores.__getitem__)
    return SampleHeader(
        sample_id=new_sample_id(),
        fleet="plant-3",
        agent="cam-017",
        captured_at=datetime(2025, 6, 1, 12, 30, 15, 123456, tzinfo=UTC),
        model_name="resnet18-student",
        model_version="1.4.0",
        scores=scores,
        predicted=predicted,
        confidence=scores[predicted],
        route_reason="low_confidence",
        priority=3,
        image_format="jpeg",
        image_width=640,
        image_height=480,
        image_bytes=48_211,
        meta={"source": "rtsp"},
    )


def test_typical_sample_overhead_is_at_most_512_bytes() -> None:
    """Measured: 502 bytes (12-byte prefix + 490-byte JSON header) for the typical sample."""
    header = typical_header()
    overhead = envelope_overhead(header)
    assert overhead == PREFIX_SIZE + len(encode_message(header))
    print(f"typical envelope overhead: {overhead} bytes")
    assert overhead <= 512


def test_layout(make_header: HeaderFactory, small_images: dict[str, bytes]) -> None:
    image = small_images["jpeg-rgb-16x16"]
    header = make_header(image)
    data = encode_envelope(header, image)
    header_bytes = encode_message(header)
    magic, version, flags, header_len, crc = struct.unpack(">4sBBHI", data[:12])
    assert (magic, version, flags, header_len) == (b"ELSE", 1, 0, len(header_bytes))
    assert crc == zlib.crc32(data[12:])
    assert data[12 : 12 + header_len] == header_bytes
    assert data[12 + header_len :] == image  # raw, never base64
    assert len(data) == envelope_overhead(header) + len(image)


def test_a_stand_in_peeks_at_the_sample_id_without_decoding(
    make_header: HeaderFactory, small_images: dict[str, bytes]
) -> None:
    image = small_images["jpeg-rgb-16x16"]
    header = make_header(image)
    data = encode_envelope(header, image)
    assert peek_sample_id(data) == header.sample_id
    assert peek_sample_id(bytearray(data)) == header.sample_id
    # Unchecked: a corrupted image still names its id (decode_envelope refuses it).
    corrupted = data[:-1] + bytes([data[-1] ^ 0xFF])
    assert peek_sample_id(corrupted) == header.sample_id
    with pytest.raises(ChecksumError):
        decode_envelope(corrupted)
    for unreadable in (b"", data[: PREFIX_SIZE + 3], raw_envelope(b'{"no": "id"}', image)):
        with pytest.raises(EnvelopeError, match="no sample id"):
            peek_sample_id(unreadable)


@pytest.mark.parametrize(
    "name",
    [
        "png-rgb-8x6",
        "png-l-1x1",
        "png-rgba-17x3",
        "jpeg-rgb-16x16",
        "jpeg-l-9x5",
        "jpeg-progressive-33x21",
    ],
)
def test_round_trip_real_images(
    name: str, make_header: HeaderFactory, small_images: dict[str, bytes]
) -> None:
    image = small_images[name]
    header = make_header(image)
    envelope = decode_envelope(encode_envelope(header, image))
    assert envelope == Envelope(header=header, image=image, info=probe_image(image))
    assert decode_envelope(bytearray(encode_envelope(header, image))) == envelope
    assert decode_envelope(memoryview(encode_envelope(header, image))) == envelope


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.data())
def test_round_trip_generated_headers(
    data: st.DataObject,
    header_strategy: st.SearchStrategy[dict[str, Any]],
    small_images: dict[str, bytes],
    make_header: HeaderFactory,
) -> None:
    image = small_images[data.draw(st.sampled_from(sorted(small_images)))]
    header = make_header(image, **data.draw(header_strategy))
    limits = EnvelopeLimits(max_header_bytes=8192)
    envelope = decode_envelope(encode_envelope(header, image, limits), limits)
    assert envelope.header == header
    assert envelope.image == image


# --- damage -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(make_header: HeaderFactory, small_images: dict[str, bytes]) -> bytes:
    image = small_images["png-rgb-8x6"]
    return encode_envelope(make_header(image), image)


def test_every_truncation_is_refused(good: bytes) -> None:
    for cut in range(len(good)):
        with pytest.raises(EnvelopeError):
            decode_envelope(good[:cut])


def test_truncated_prefix_and_header(good: bytes) -> None:
    with pytest.raises(TruncatedEnvelopeError):
        decode_envelope(good[:11])
    header_len = struct.unpack(">H", good[6:8])[0]
    with pytest.raises(TruncatedEnvelopeError, match="inside its"):
        decode_envelope(good[: PREFIX_SIZE + header_len - 1])


@pytest.mark.parametrize("mask", [0x01, 0x20, 0x80, 0xFF])
def test_every_single_byte_flip_is_refused(good: bytes, mask: int) -> None:
    for position in range(len(good)):
        damaged = bytearray(good)
        damaged[position] ^= mask
        with pytest.raises(ContractError) as info:
            decode_envelope(bytes(damaged))
        if position < 4:
            assert isinstance(info.value, BadMagicError)
        elif position in (4, 5):
            assert type(info.value) is EnvelopeError
        elif position >= 8:
            assert isinstance(info.value, ChecksumError)  # the CRC covers header and image
        # A changed header length (bytes 6-7) moves the header/image split, which the
        # CRC does not see: the header is then cut or followed by image bytes (which
        # start with 0x89 or 0xFF, never JSON whitespace), so it fails as JSON, or it
        # runs past a limit or past the end.


def test_wrong_magic(good: bytes) -> None:
    with pytest.raises(BadMagicError) as info:
        decode_envelope(b"ELSF" + good[4:])
    assert info.value.reason == "bad_magic"
    with pytest.raises(BadMagicError):
        decode_envelope(b'{"schema": "edgeloop.sample"}')


def test_unknown_version_and_flags(good: bytes) -> None:
    with pytest.raises(EnvelopeError, match="version 2") as info:
        decode_envelope(good[:4] + b"\x02" + good[5:])
    assert info.value.reason == "unsupported_version"
    with pytest.raises(EnvelopeError, match="flags") as info:
        decode_envelope(good[:5] + b"\x01" + good[6:])
    assert info.value.reason == "unsupported_flags"


def test_limits_are_checked_with_the_right_name(
    make_header: HeaderFactory, small_images: dict[str, bytes]
) -> None:
    image = small_images["jpeg-rgb-16x16"]
    data = encode_envelope(make_header(image), image)
    header_len = struct.unpack(">H", data[6:8])[0]

    with pytest.raises(LimitExceededError) as info:
        decode_envelope(data, EnvelopeLimits(max_header_bytes=header_len - 1))
    assert (info.value.limit, info.value.actual, info.value.allowed) == (
        "header_bytes",
        header_len,
        header_len - 1,
    )
    with pytest.raises(LimitExceededError) as info:
        decode_envelope(data, EnvelopeLimits(max_image_bytes=len(image) - 1))
    assert info.value.limit == "image_bytes" and info.value.actual == len(image)
    with pytest.raises(LimitExceededError) as info:
        decode_envelope(data, EnvelopeLimits(max_pixels=255))
    assert (info.value.limit, info.value.actual, info.value.allowed) == ("pixels", 256, 255)
    assert info.value.reason == "too_large"
    assert decode_envelope(data, EnvelopeLimits(max_pixels=256)).image == image

    buffer = io.BytesIO()
    Image.new("L", (2100, 2000), 128).save(buffer, format="PNG")
    big = buffer.getvalue()
    with pytest.raises(LimitExceededError) as info:
        encode_envelope(make_header(big), big)
    assert info.value.limit == "pixels"
    limits = EnvelopeLimits(max_pixels=5_000_000)
    assert decode_envelope(encode_envelope(make_header(big), big, limits), limits).image == big


def test_encode_checks_limits_too(
    make_header: HeaderFactory, small_images: dict[str, bytes]
) -> None:
    image = small_images["png-rgb-8x6"]
    header = make_header(image)
    with pytest.raises(LimitExceededError) as info:
        encode_envelope(header, image, EnvelopeLimits(max_header_bytes=100))
    assert info.value.limit == "header_bytes"
    with pytest.raises(LimitExceededError) as info:
        encode_envelope(header, image, EnvelopeLimits(max_image_bytes=10))
    assert info.value.limit == "image_bytes"


def test_limits_are_checked_before_the_crc(good: bytes) -> None:
    corrupted = good[:8] + b"\x00\x00\x00\x00" + good[12:]
    with pytest.raises(LimitExceededError):
        decode_envelope(corrupted, EnvelopeLimits(max_image_bytes=1))
    with pytest.raises(LimitExceededError):
        decode_envelope(corrupted, EnvelopeLimits(max_header_bytes=10))
    with pytest.raises(ChecksumError):
        decode_envelope(corrupted)


def test_encode_refuses_an_inconsistent_header(
    make_header: HeaderFactory, small_images: dict[str, bytes]
) -> None:
    png, jpeg = small_images["png-rgb-8x6"], small_images["jpeg-rgb-16x16"]
    with pytest.raises(ImageFormatError, match="image bytes"):
        encode_envelope(make_header(png, image_bytes=len(png) + 1), png)
    with pytest.raises(ImageFormatError, match="header says png"):
        encode_envelope(make_header(jpeg, image_format="png"), jpeg)
    with pytest.raises(ImageFormatError, match="header says 9x6"):
        encode_envelope(make_header(png, image_width=9), png)
    with pytest.raises(ImageFormatError, match="expected a JPEG or PNG"):
        encode_envelope(make_header(png, image_bytes=4), b"GIF8")


def test_decode_checks_the_header_against_the_image(
    make_header: HeaderFactory, small_images: dict[str, bytes]
) -> None:
    png, jpeg = small_images["png-rgb-8x6"], small_images["jpeg-rgb-16x16"]

    def packed(image: bytes, **overrides: Any) -> bytes:
        return raw_envelope(encode_message(make_header(image, **overrides)), image)

    with pytest.raises(TruncatedEnvelopeError, match="image bytes"):
        decode_envelope(packed(png, image_bytes=len(png) + 5))
    with pytest.raises(TruncatedEnvelopeError, match="image bytes"):
        decode_envelope(packed(png, image_bytes=len(png) - 5))
    with pytest.raises(ImageFormatError, match="header says jpeg"):
        decode_envelope(packed(png, image_format="jpeg"))
    with pytest.raises(ImageFormatError, match="but the image is 16x16"):
        decode_envelope(packed(jpeg, image_height=15))
    garbage = b"\x00" * 64
    header = encode_message(make_header(png, image_bytes=len(garbage)))
    with pytest.raises(ImageFormatError, match="expected a JPEG or PNG"):
        decode_envelope(raw_envelope(header, garbage))


def test_decode_refuses_bad_headers_as_message_errors(
    make_header: HeaderFactory, small_images: dict[str, bytes]
) -> None:
    image = small_images["png-rgb-8x6"]
    obj = json.loads(encode_message(make_header(image)))
    newer = dict(obj, v=2)
    with pytest.raises(UnsupportedVersionError):
        decode_envelope(raw_envelope(json.dumps(newer).encode(), image))
    other = dict(obj, schema="edgeloop.verdict")
    with pytest.raises(UnknownSchemaError):
        decode_envelope(raw_envelope(json.dumps(other).encode(), image))
    with pytest.raises(MessageValidationError):
        decode_envelope(raw_envelope(b"", image))
    with pytest.raises(MessageValidationError):
        decode_envelope(raw_envelope(b"\xff" * 20, image))


@settings(max_examples=500, deadline=None, database=None)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.binary(max_size=300).map(lambda b: MAGIC + b),
        st.binary(max_size=300).map(lambda b: MAGIC + b"\x01\x00" + b),
        st.tuples(st.binary(max_size=200), st.binary(max_size=100)).map(
            lambda hi: raw_envelope(*hi)
        ),
    )
)
def test_garbage_only_raises_contract_errors(data: bytes) -> None:
    try:
        decode_envelope(data)
    except ContractError:
        return
    pytest.fail("garbage decoded as an envelope")
