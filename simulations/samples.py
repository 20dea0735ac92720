"""Inputs the simulations send: random images, sample headers, progressive JPEGs and bombs.

    image = image_bytes(32, seed=3)
    header = sample_header(image, fleet="fleet-soak", agent="cam-0")
    payload = encode_envelope(header, image)

``scan_bomb(n)`` is a structurally valid progressive JPEG with ``n`` scans (its smallest
scan repeated): what a hostile device sends to make a decoder work per scan.
"""

from __future__ import annotations

import io
import re
from datetime import UTC, datetime

import numpy as np
from PIL import Image

from shared.ids import new_sample_id
from shared.messages import SampleHeader

__all__ = ["CLASSES", "SIZE", "image_bytes", "progressive_jpeg", "sample_header", "scan_bomb"]

CLASSES = 10
SIZE = 32

_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def image_bytes(size: int = SIZE, fmt: str = "JPEG", seed: int = 0) -> bytes:
    """A ``size`` x ``size`` image of seeded random pixels, encoded as ``fmt``."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def sample_header(
    image: bytes,
    *,
    fleet: str = "fleet-a",
    agent: str = "cam-1",
    sample_id: str | None = None,
    size: int = SIZE,
    fmt: str = "jpeg",
    priority: int = 5,
    predicted: int = 0,
    confidence: float = 0.4,
    captured_at: datetime | None = None,
) -> SampleHeader:
    """The header an agent sends with ``image``: ten classes, an unsure student."""
    scores = [0.0] * CLASSES
    scores[predicted] = confidence
    scores[(predicted + 1) % CLASSES] = 1 - confidence
    return SampleHeader(
        sample_id=sample_id or new_sample_id(),
        fleet=fleet,
        agent=agent,
        captured_at=captured_at or datetime.now(UTC),
        model_name="student",
        model_version="s-1",
        scores=scores,
        predicted=predicted,
        confidence=confidence,
        route_reason="low_confidence",
        priority=priority,
        image_format=fmt,
        image_width=size,
        image_height=size,
        image_bytes=len(image),
    )


def progressive_jpeg(size: int = 64, *, seed: int = 0) -> bytes:
    """A small progressive JPEG, as Pillow (libjpeg's default script, ten scans) writes it."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", progressive=True, quality=90)
    return buffer.getvalue()


def _split_scans(jpeg: bytes) -> tuple[bytes, list[bytes]]:
    """(everything before the first SOS, [each SOS segment with its entropy-coded data])."""
    first = jpeg.index(b"\xff\xda")
    scans = []
    pos = first
    while jpeg[pos : pos + 2] == b"\xff\xda":
        length = int.from_bytes(jpeg[pos + 2 : pos + 4], "big")
        found = _NEXT_MARKER.search(jpeg, pos + 2 + length)
        if found is None:
            raise ValueError("a scan runs to the end of the JPEG")
        scans.append(jpeg[pos : found.start()])
        pos = found.start()
        # DHT segments between scans travel with the scan that follows them.
        while jpeg[pos : pos + 2] not in (b"\xff\xda", b"\xff\xd9"):
            seg = 2 + int.from_bytes(jpeg[pos + 2 : pos + 4], "big")
            scans[-1] += jpeg[pos : pos + seg]
            pos += seg
    return jpeg[:first], scans


def scan_bomb(scans: int, *, size: int = 64) -> bytes:
    """A structurally valid progressive JPEG with ``scans`` scans: its smallest scan repeated."""
    head, own = _split_scans(progressive_jpeg(size))
    smallest = min(own, key=len)
    extra = max(0, scans - len(own))
    return head + b"".join(own) + smallest * extra + b"\xff\xd9"
