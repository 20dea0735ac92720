"""The reference scenario: real handwritten digits seen by a camera over a conveyor belt.

The source images are scikit-learn's bundled ``load_digits()`` (1,797 real 8x8 scans,
10 classes), so nothing is downloaded. Each scan is rendered as an RGB uint8 frame:
the digit, scaled and placed at random, inked onto a procedurally generated belt
texture (tinted slats, mottling, grain). Everything is deterministic given the
``ScenarioConfig``.

Splits are made over source scans, never over frames, so a scan seen in training
never reappears in validation, test or the stream pool; only the number of
renders per scan differs between splits.
"""

from __future__ import annotations

import colorsys
import functools
import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from PIL import Image

from distill.frames import FrameSet

__all__ = [
    "DIGIT_CLASSES",
    "SPLITS",
    "DigitSources",
    "ScenarioConfig",
    "Split",
    "alternate_background",
    "conveyor_background",
    "load_digit_sources",
    "render_digit",
    "render_split",
    "split_indices",
]

DIGIT_CLASSES: tuple[str, ...] = tuple(str(d) for d in range(10))
Split = Literal["train", "validation", "test", "stream"]
SPLITS: tuple[Split, ...] = ("train", "validation", "test", "stream")
# Salt per split so a scan rendered in two configs with the same seed still gets
# independent placements per split.
_SPLIT_CODE = {"train": 1, "validation": 2, "test": 3, "stream": 4}
# Texture sizes were tuned at this frame size; other sizes scale them.
_BASE_SIZE = 64


@dataclass(frozen=True)
class ScenarioConfig:
    """How the digits become frames; every field goes into model cache keys."""

    frame_size: int = 64
    seed: int = 0
    # Fractions of the source scans for train, validation, test and the stream pool.
    split_fractions: tuple[float, float, float, float] = (0.6, 0.1, 0.2, 0.1)
    train_renders: int = 8
    eval_renders: int = 2
    stream_renders: int = 4
    # Digit side as a fraction of the frame side. Below ~0.45 of 64 px the 8x8 scan
    # is drawn at under 4 px per source pixel and stroke detail drowns in the texture.
    scale_range: tuple[float, float] = (0.5, 0.8)
    max_tilt_degrees: float = 6.0

    def __post_init__(self) -> None:
        if self.frame_size < 16:
            raise ValueError(f"frame_size must be at least 16, got {self.frame_size}")
        if len(self.split_fractions) != 4 or any(f <= 0 for f in self.split_fractions):
            raise ValueError(f"split_fractions must be 4 positive numbers: {self.split_fractions}")
        if abs(sum(self.split_fractions) - 1.0) > 1e-6:
            raise ValueError(f"split_fractions must sum to 1: {self.split_fractions}")
        lo, hi = self.scale_range
        if not 0.1 <= lo <= hi <= 1.0:
            raise ValueError(f"scale_range must satisfy 0.1 <= lo <= hi <= 1: {self.scale_range}")
        if min(self.train_renders, self.eval_renders, self.stream_renders) < 1:
            raise ValueError("every split needs at least one render per scan")

    def renders(self, split: Split) -> int:
        if split == "train":
            return self.train_renders
        if split == "stream":
            return self.stream_renders
        return self.eval_renders

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class DigitSources:
    """The 1,797 source scans: ink coverage in [0, 1] and their labels."""

    images: np.ndarray  # float32 [N, 8, 8]
    labels: np.ndarray  # int64 [N]
    identity: str


@functools.lru_cache(maxsize=1)
def load_digit_sources() -> DigitSources:
    """scikit-learn's bundled digits, with an identity derived from their bytes."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (np.asarray(bunch.images, dtype=np.float32) / 16.0).clip(0.0, 1.0)
    labels = np.asarray(bunch.target, dtype=np.int64)
    digest = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()[:16]
    images.setflags(write=False)
    labels.setflags(write=False)
    return DigitSources(images=images, labels=labels, identity=f"sklearn-digits:{digest}")


def split_indices(
    labels: np.ndarray, fractions: tuple[float, ...], seed: int
) -> dict[Split, np.ndarray]:
    """Stratified split of source indices; every index lands in exactly one split."""
    rng = np.random.default_rng([seed, 7919])
    parts: dict[Split, list[np.ndarray]] = {s: [] for s in SPLITS}
    bounds = np.cumsum((0.0, *fractions))
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        # Rounded cumulative bounds keep each class's split sizes within one scan of ideal.
        cuts = np.round(bounds * len(members)).astype(int)
        for split, lo, hi in zip(SPLITS, cuts[:-1], cuts[1:], strict=True):
            parts[split].append(members[lo:hi])
    return {s: np.sort(np.concatenate(p)) for s, p in parts.items()}


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    return np.asarray(colorsys.hsv_to_rgb(h % 1.0, s, v), dtype=np.float32) * 255.0


def _smooth_noise(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    """Low-frequency noise in roughly [-1, 1]: a coarse grid upsampled bilinearly."""
    coarse = rng.standard_normal((cells, cells)).astype(np.float32)
    img = Image.fromarray(coarse, mode="F").resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(img, dtype=np.float32)


@functools.lru_cache(maxsize=8)
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    yy.setflags(write=False)
    xx.setflags(write=False)
    return yy, xx


def conveyor_background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A belt seen from above: tinted slats across the direction of travel, mottling, grain.

    Returns float32 [size, size, 3] in pixel units (0..255, not yet clipped).
    """
    k = size / _BASE_SIZE
    _, xx = _grid(size)
    base = _hsv(rng.uniform(0.0, 1.0), rng.uniform(0.05, 0.35), rng.uniform(0.5, 0.8))
    period = rng.uniform(5.0, 11.0) * k
    phase = rng.uniform(0.0, 2.0 * math.pi)
    slats = 1.0 + rng.uniform(0.04, 0.10) * np.sin(2.0 * math.pi * xx / period + phase)
    # A darker seam every few slats: belts are joined, and the seam moves with the belt.
    seam_every = period * int(rng.integers(3, 6))
    seam_phase = rng.uniform(0.0, seam_every)
    seam = np.abs(((xx + seam_phase) % seam_every) - seam_every / 2) > seam_every / 2 - 1.0 * k
    shade = slats * (1.0 + 0.06 * _smooth_noise(rng, size, 5)) * np.where(seam, 0.8, 1.0)
    grain = rng.normal(0.0, rng.uniform(2.0, 6.0), (size, size, 1)).astype(np.float32)
    return base[None, None, :] * shade[..., None] + grain


def alternate_background(
    rng: np.random.Generator, size: int, *, tread: float = 0.35, scuff_opacity: float = 0.85
) -> np.ndarray:
    """A different belt: high-contrast diagonal tread plus dark, stroke-like scuffs.

    The scuffs are about as dark as ink but thinner than a digit stroke, so a model
    that learned "dark means digit" is misled while the digit stays readable.
    Returns float32 [size, size, 3] in pixel units.
    """
    k = size / _BASE_SIZE
    yy, xx = _grid(size)
    base = _hsv(rng.uniform(0.0, 1.0), rng.uniform(0.2, 0.6), rng.uniform(0.6, 0.85))
    angle = rng.uniform(math.radians(25), math.radians(65)) * rng.choice([-1.0, 1.0])
    period = rng.uniform(6.0, 10.0) * k
    u = xx * math.cos(angle) + yy * math.sin(angle)
    pattern = 1.0 + tread * np.sign(np.sin(2.0 * math.pi * u / period))
    bg = base[None, None, :] * (pattern * (1.0 + 0.1 * _smooth_noise(rng, size, 4)))[..., None]
    scuffs = np.zeros((size, size), dtype=np.float32)
    for _ in range(int(rng.integers(4, 8))):
        x0, y0 = rng.uniform(0, size, 2)
        theta = rng.uniform(0.0, math.pi)
        length = rng.uniform(10.0, 28.0) * k
        width = rng.uniform(0.8, 1.8) * k
        # Distance from each pixel to the segment, thresholded into a soft line.
        dx, dy = math.cos(theta), math.sin(theta)
        t = np.clip((xx - x0) * dx + (yy - y0) * dy, 0.0, length)
        dist = np.hypot(xx - (x0 + t * dx), yy - (y0 + t * dy))
        scuffs = np.maximum(scuffs, np.clip(1.0 + width / 2 - dist, 0.0, 1.0))
    dark = _hsv(rng.uniform(0.0, 1.0), 0.2, rng.uniform(0.05, 0.2))
    scuffs = scuffs[..., None] * scuff_opacity
    grain = rng.normal(0.0, 3.0, (size, size, 1)).astype(np.float32)
    return bg * (1.0 - scuffs) + dark * scuffs + grain


def render_digit(
    digit: np.ndarray,
    rng: np.random.Generator,
    *,
    frame_size: int = 64,
    scale_range: tuple[float, float] = (0.5, 0.8),
    max_tilt_degrees: float = 6.0,
) -> tuple[np.ndarray, np.ndarray]:
    """One 8x8 scan (ink in [0, 1]) as a camera frame.

    Returns (frame uint8 [H, W, 3], mask float32 [H, W] = ink coverage).
    """
    size = frame_size
    background = conveyor_background(rng, size)
    side = rng.uniform(*scale_range) * size
    aspect = rng.uniform(0.85, 1.15)
    w = max(4, round(side * math.sqrt(aspect)))
    h = max(4, round(side / math.sqrt(aspect)))
    glyph_img = Image.fromarray(np.ascontiguousarray(digit, dtype=np.float32), mode="F")
    glyph_img = glyph_img.resize((w, h), Image.Resampling.BICUBIC)
    tilt = rng.uniform(-max_tilt_degrees, max_tilt_degrees)
    if tilt:
        glyph_img = glyph_img.rotate(tilt, resample=Image.Resampling.BILINEAR, expand=False)
    # Bicubic upsampling of an 8x8 scan leaves soft halos; a gentle contrast stretch
    # makes strokes read as ink rather than smudge.
    glyph = np.clip((np.asarray(glyph_img, dtype=np.float32) - 0.1) * 1.3, 0.0, 1.0)
    h, w = min(h, size), min(w, size)
    glyph = glyph[:h, :w]
    y0 = int(rng.integers(0, size - h + 1))
    x0 = int(rng.integers(0, size - w + 1))
    mask = np.zeros((size, size), dtype=np.float32)
    mask[y0 : y0 + h, x0 : x0 + w] = glyph * rng.uniform(0.85, 1.0)
    ink = _hsv(rng.uniform(0.0, 1.0), rng.uniform(0.0, 0.3), rng.uniform(0.05, 0.25))
    alpha = mask[..., None]
    frame = background * (1.0 - alpha) + ink[None, None, :] * alpha
    frame *= rng.uniform(0.92, 1.08)  # the plant's lights are never quite constant
    return np.clip(np.rint(frame), 0, 255).astype(np.uint8), mask


@functools.lru_cache(maxsize=16)
def render_split(split: Split, config: ScenarioConfig = ScenarioConfig()) -> FrameSet:
    """All frames of one split; cached per process and returned read-only."""
    if split not in _SPLIT_CODE:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    sources = load_digit_sources()
    index = split_indices(sources.labels, config.split_fractions, config.seed)[split]
    renders = config.renders(split)
    n = len(index) * renders
    size = config.frame_size
    frames = np.empty((n, size, size, 3), dtype=np.uint8)
    masks = np.empty((n, size, size), dtype=np.float32)
    labels = np.empty(n, dtype=np.int64)
    source_ids = np.empty(n, dtype=np.int64)
    row = 0
    for r in range(renders):
        for src in index:
            # A generator per frame: a frame does not change when other splits or
            # render counts do.
            rng = np.random.default_rng([config.seed, _SPLIT_CODE[split], int(src), r])
            frames[row], masks[row] = render_digit(
                sources.images[src],
                rng,
                frame_size=size,
                scale_range=config.scale_range,
                max_tilt_degrees=config.max_tilt_degrees,
            )
            labels[row] = sources.labels[src]
            source_ids[row] = src
            row += 1
    for arr in (frames, masks, labels, source_ids):
        arr.setflags(write=False)
    params = hashlib.sha256(repr(sorted(config.as_dict().items())).encode()).hexdigest()[:12]
    return FrameSet(
        frames=frames,
        labels=labels,
        class_names=DIGIT_CLASSES,
        masks=masks,
        sources=source_ids,
        identity=f"{sources.identity}/scenario:{params}/{split}",
        notes={"split": split, "renders_per_scan": renders, "scans": len(index)},
    )
