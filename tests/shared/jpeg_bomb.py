"""Test JPEGs: a progressive JPEG split into its scans, and a "scan bomb" built from it."""

from __future__ import annotations

import io
import re

import numpy as np
from PIL import Image

__all__ = ["progressive_jpeg", "scan_bomb"]

_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


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
        assert found is not None
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
