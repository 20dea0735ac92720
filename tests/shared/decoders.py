"""Decoders for the decode pool's tests, run inside its worker processes."""

from __future__ import annotations

import ctypes
import io
import os
import time
from pathlib import Path

import numpy as np
from PIL import Image

from shared.errors import ImageError

__all__ = ["crash", "echo", "hang", "pid", "refuse", "slow_progressive_jpeg"]


def slow_progressive_jpeg(side: int = 2000) -> bytes:
    """A progressive JPEG of ``side`` x ``side`` pixels (ten scans, a few hundred KB): within
    every limit, and tens of milliseconds to decode, far past a budget of one."""
    y, x = np.mgrid[0:side, 0:side]
    noise = np.random.default_rng(0).integers(0, 8, (side, side, 3), dtype=np.uint8)
    pixels = ((x + y) % 256).astype(np.uint8)[..., None] + noise
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", progressive=True, quality=80)
    return buffer.getvalue()


def echo(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes as an array of ``shape``."""
    return np.frombuffer(data, np.uint8).reshape(shape)


def pid(data: bytes) -> np.ndarray:
    """The worker's process id, as 8 bytes."""
    return np.frombuffer(os.getpid().to_bytes(8, "little"), np.uint8)


def hang(started: str, data: bytes, *args: object) -> np.ndarray:
    """Say it started (a file), then never return: a decode that would run forever.

    ``functools.partial(hang, path)`` stands in for any decoder, whatever its arguments.
    """
    Path(started).write_text(str(os.getpid()))
    while True:
        time.sleep(3600)


def crash(data: bytes, *args: object) -> np.ndarray:
    """Read address 0: the worker dies of a segmentation fault, as a decoder bug would."""
    ctypes.string_at(0)
    raise AssertionError("unreachable")


def refuse(data: bytes) -> np.ndarray:
    """A decoder's own refusal of the bytes."""
    raise ImageError("these bytes are not an image", reason="undecodable")
