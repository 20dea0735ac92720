"""The reference detection scenario: several handwritten digits per frame on a conveyor belt.

A frame is a belt seen from above (``distill.scenario.conveyor_background``) with
zero to six digits lying on it, each a real 8x8 scan from scikit-learn's bundled
``load_digits()`` inked at its own size, tilt and shade, plus clutter that is not an
object (nuts, strips of tape, stains) and is never boxed. Digits may overlap
partially; placement caps the overlap so every box stays at least
``SceneConfig.min_visible`` visible. Everything is deterministic given the
``SceneConfig`` and the split.

Ground truth per frame ``i`` of a ``DetectionSet``:

- ``boxes[i]``: float32 [k, 4], pixel xyxy, the tight box of the digit's ink
  (pixels with coverage >= ``INK_THRESHOLD``), clipped to the frame;
- ``classes[i]``: int64 [k], the digit 0-9;
- ``visible[i]``: float32 [k], the fraction of the box not covered by the boxes of
  objects lying on top of it (``box_visibility``) nor cut off by the frame edge.

Box coordinates are pixel edges: (x1, y1, x2, y2) covers columns x1..x2-1 and rows
y1..y2-1, so x2 - x1 is the width in pixels. The objects of a frame are listed in
drawing order: a later object lies on top of the earlier ones.

Splits are made over source scans with the classification scenario's
``split_indices``, never over frames: a scan in a training frame never appears in a
validation, test or stream frame. Each frame draws its scans from its split's pool
with its own generator, so a frame does not change when the number of frames does.
``apply_scene_drift`` (``distill.scene_drift``) applies the named drifts of
``distill.drift`` with the boxes kept true.
"""

from __future__ import annotations

import colorsys
import contextlib
import functools
import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from PIL import Image
from scipy.spatial import ConvexHull, QhullError

from distill.scenario import (
    DIGIT_CLASSES,
    SPLITS,
    DigitSources,
    Split,
    conveyor_background,
    load_digit_sources,
    split_indices,
)

__all__ = [
    "INK_THRESHOLD",
    "DetectionSet",
    "SceneConfig",
    "box_visibility",
    "render_scenes",
]

# Coverage at or above which a pixel counts as a digit's ink: the box is tight
# around these pixels; fainter halo pixels outside it are cut away.
INK_THRESHOLD = 0.25
# Salt per split and for the detection scenario, so its generators never coincide
# with the classification scenario's for the same seed.
_SPLIT_CODE = {"train": 1, "validation": 2, "test": 3, "stream": 4}
_SCENE_SALT = 382_541
# An 8x8 scan drawn smaller than this is no longer a legible digit.
_MIN_SIDE_PX = 6
_PLACEMENT_TRIES = 30


@dataclass(frozen=True)
class SceneConfig:
    """How scenes are rendered; every field goes into model cache keys."""

    frame_size: int = 320
    seed: int = 0
    # Fractions of the source scans for train, validation, test and the stream pool.
    split_fractions: tuple[float, float, float, float] = (0.6, 0.1, 0.2, 0.1)
    train_frames: int = 1000
    eval_frames: int = 250  # validation and test, each
    stream_frames: int = 500
    # Probability of 0, 1, 2, ... objects in a frame; the length sets the maximum.
    count_weights: tuple[float, ...] = (0.08, 0.16, 0.20, 0.20, 0.16, 0.12, 0.08)
    # Digit side as a fraction of the frame side (24..72 px at 320 px), never under
    # 6 px.
    scale_range: tuple[float, float] = (0.075, 0.225)
    max_tilt_degrees: float = 12.0
    # Least fraction of a box left uncovered by the boxes of objects on top of it.
    min_visible: float = 0.6
    # Inclusive range of the number of clutter items (not objects) per frame.
    distractor_range: tuple[int, int] = (0, 4)

    def __post_init__(self) -> None:
        if self.frame_size < 32:
            raise ValueError(f"frame_size must be at least 32, got {self.frame_size}")
        if len(self.split_fractions) != 4 or any(f <= 0 for f in self.split_fractions):
            raise ValueError(f"split_fractions must be 4 positive numbers: {self.split_fractions}")
        if abs(sum(self.split_fractions) - 1.0) > 1e-6:
            raise ValueError(f"split_fractions must sum to 1: {self.split_fractions}")
        if min(self.train_frames, self.eval_frames, self.stream_frames) < 1:
            raise ValueError("every split needs at least one frame")
        w = self.count_weights
        if not 1 <= len(w) <= 11 or any(p < 0 for p in w) or abs(sum(w) - 1.0) > 1e-6:
            raise ValueError(
                f"count_weights must be 1 to 11 non-negative probabilities summing to 1: {w}"
            )
        lo, hi = self.scale_range
        if not 0.02 <= lo <= hi <= 0.5:
            raise ValueError(
                f"scale_range must satisfy 0.02 <= lo <= hi <= 0.5: {self.scale_range}"
            )
        if not 0.0 <= self.max_tilt_degrees <= 45.0:
            raise ValueError(f"max_tilt_degrees must be in [0, 45], got {self.max_tilt_degrees}")
        if not 0.0 < self.min_visible <= 1.0:
            raise ValueError(f"min_visible must be in (0, 1], got {self.min_visible}")
        dlo, dhi = self.distractor_range
        if not 0 <= dlo <= dhi:
            raise ValueError(
                f"distractor_range must satisfy 0 <= lo <= hi: {self.distractor_range}"
            )

    @property
    def max_objects(self) -> int:
        return len(self.count_weights) - 1

    def frame_count(self, split: Split) -> int:
        if split == "train":
            return self.train_frames
        if split == "stream":
            return self.stream_frames
        return self.eval_frames

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class DetectionSet:
    """RGB frames with any number of boxed objects each, uint8 NHWC, all of one square size.

    Per frame ``i``: ``boxes[i]`` float32 [k, 4] pixel xyxy, ``classes[i]`` int64 [k]
    indexing ``class_names``, and optionally ``visible[i]`` float32 [k] (fraction of
    each box in view). ``masks`` (ink coverage of all objects, uint8 0..255, [N, H, W])
    lets a background change keep the objects in front; ``outlines[i]`` float32
    [k, P, 2] holds (x, y) points whose convex hull is each object's ink (padded by
    repetition), so a rotation moves boxes exactly instead of inflating them.
    ``sources[i]`` int64 [k] names each object's source scan for leakage checks.
    """

    frames: np.ndarray
    boxes: list[np.ndarray]
    classes: list[np.ndarray]
    class_names: tuple[str, ...]
    visible: list[np.ndarray] | None = None
    masks: np.ndarray | None = None
    outlines: list[np.ndarray] | None = None
    sources: list[np.ndarray] | None = None
    identity: str = ""
    notes: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        f = self.frames
        if f.dtype != np.uint8 or f.ndim != 4 or f.shape[-1] != 3 or f.shape[1] != f.shape[2]:
            raise ValueError(f"frames must be uint8 [N, S, S, 3], got {f.dtype} {f.shape}")
        n = len(f)
        if len(self.boxes) != n or len(self.classes) != n:
            raise ValueError(f"boxes and classes need one entry per frame ({n})")
        if self.masks is not None and (
            self.masks.dtype != np.uint8 or self.masks.shape != f.shape[:3]
        ):
            raise ValueError(
                f"masks must be uint8 [N, H, W], got {self.masks.dtype} {self.masks.shape}"
            )
        extras = {"visible": self.visible, "outlines": self.outlines, "sources": self.sources}
        for name, values in extras.items():
            if values is not None and len(values) != n:
                raise ValueError(f"{name} needs one entry per frame ({n}), got {len(values)}")
        for i in range(n):
            k = len(self.classes[i])
            if self.boxes[i].shape != (k, 4) or self.classes[i].shape != (k,):
                raise ValueError(
                    f"frame {i}: boxes must be [k, 4] and classes [k], got"
                    f" {self.boxes[i].shape} and {self.classes[i].shape}"
                )
            if k and (self.classes[i].min() < 0 or self.classes[i].max() >= len(self.class_names)):
                raise ValueError(f"frame {i}: class index outside class_names")
            for name, values in extras.items():
                if values is not None and len(values[i]) != k:
                    raise ValueError(
                        f"frame {i}: {name} has {len(values[i])} entries for {k} boxes"
                    )

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def frame_size(self) -> int:
        return int(self.frames.shape[1])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def object_counts(self) -> np.ndarray:
        """int64 [N]: the number of boxed objects in each frame."""
        return np.array([len(c) for c in self.classes], dtype=np.int64)

    def class_counts(self) -> dict[str, int]:
        labels = np.concatenate([np.zeros(0, np.int64), *self.classes])
        counts = np.bincount(labels, minlength=self.num_classes)
        return {name: int(c) for name, c in zip(self.class_names, counts, strict=True)}

    def subset(self, index: np.ndarray | slice | int) -> DetectionSet:
        """Frames at ``index`` (a slice, integer or integer/boolean array) with their boxes."""
        rows = np.atleast_1d(np.arange(len(self))[index])

        def pick(values: list[np.ndarray] | None) -> list[np.ndarray] | None:
            return None if values is None else [values[int(r)] for r in rows]

        return DetectionSet(
            frames=self.frames[rows],
            boxes=[self.boxes[int(r)] for r in rows],
            classes=[self.classes[int(r)] for r in rows],
            class_names=self.class_names,
            visible=pick(self.visible),
            masks=None if self.masks is None else self.masks[rows],
            outlines=pick(self.outlines),
            sources=pick(self.sources),
            identity=f"{self.identity}[subset]",
            notes=dict(self.notes),
        )


def box_visibility(boxes: np.ndarray) -> np.ndarray:
    """For boxes in drawing order, the fraction of each not covered by later boxes.

    ``boxes`` float [k, 4] xyxy; returns float32 [k] (the last box is fully visible;
    a degenerate box counts as not visible). Exact: areas are summed over the cells
    of the grid that all box edges make.
    """
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    out = np.ones(len(b), dtype=np.float32)
    for i in range(len(b)):
        x1, y1, x2, y2 = b[i]
        area = (x2 - x1) * (y2 - y1)
        if area <= 0:
            out[i] = 0.0
            continue
        above = b[i + 1 :]
        if not len(above):
            continue
        ax1, ax2 = np.clip(above[:, 0], x1, x2), np.clip(above[:, 2], x1, x2)
        ay1, ay2 = np.clip(above[:, 1], y1, y2), np.clip(above[:, 3], y1, y2)
        xs = np.unique(np.concatenate([[x1, x2], ax1, ax2]))
        ys = np.unique(np.concatenate([[y1, y2], ay1, ay2]))
        cx, cy = (xs[:-1] + xs[1:]) / 2, (ys[:-1] + ys[1:]) / 2
        inside_x = (cx[None, :] > ax1[:, None]) & (cx[None, :] < ax2[:, None])  # [m, nx]
        inside_y = (cy[None, :] > ay1[:, None]) & (cy[None, :] < ay2[:, None])  # [m, ny]
        covered = (inside_y[:, :, None] & inside_x[:, None, :]).any(axis=0)  # [ny, nx]
        cells = np.outer(np.diff(ys), np.diff(xs))
        out[i] = float(max(0.0, 1.0 - (cells * covered).sum() / area))
    return out


# ---------------------------------------------------------------------------------
# Rendering


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    """An RGB colour in pixel units from hue, saturation, value in [0, 1]."""
    return np.asarray(colorsys.hsv_to_rgb(h % 1.0, s, v), dtype=np.float32) * 255.0


def _window(
    cx: float, cy: float, radius: float, size: int
) -> tuple[tuple[slice, slice], np.ndarray, np.ndarray] | None:
    """The frame region within ``radius`` of a centre: its slices and pixel-centre offsets."""
    y0, y1 = max(0, math.floor(cy - radius)), min(size, math.ceil(cy + radius) + 1)
    x0, x1 = max(0, math.floor(cx - radius)), min(size, math.ceil(cx + radius) + 1)
    if y0 >= y1 or x0 >= x1:
        return None
    yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)
    return (slice(y0, y1), slice(x0, x1)), yy + 0.5 - cy, xx + 0.5 - cx


def _draw_distractor(canvas: np.ndarray, rng: np.random.Generator) -> None:
    """One piece of clutter on the belt: a nut, a strip of tape or a stain."""
    size = canvas.shape[0]
    kind = int(rng.integers(3))
    cx, cy = rng.uniform(0, size, 2)
    theta = rng.uniform(0.0, math.pi)
    if kind == 0:  # a hex nut: steel, lit from one side, the belt showing through its hole
        r = max(2.0, rng.uniform(0.018, 0.035) * size)
        colour = _hsv(rng.uniform(0.5, 0.7), rng.uniform(0.0, 0.1), rng.uniform(0.45, 0.7))
        win = _window(cx, cy, r + 1, size)
        if win is None:
            return
        region, dy, dx = win
        u = dx * math.cos(theta) + dy * math.sin(theta)
        v = -dx * math.sin(theta) + dy * math.cos(theta)
        hexdist = np.maximum(np.abs(v), np.abs(u) * (math.sqrt(3) / 2) + np.abs(v) / 2)
        body = np.clip(r * math.sqrt(3) / 2 - hexdist + 0.5, 0.0, 1.0)
        hole = np.clip(0.45 * r - np.hypot(u, v) + 0.5, 0.0, 1.0)
        alpha = body * (1.0 - hole)
        paint = colour[None, None, :] * (1.0 + 0.25 * u / r)[..., None]
    elif kind == 1:  # a strip of translucent tape
        length = rng.uniform(0.08, 0.25) * size
        width = max(1.5, rng.uniform(0.02, 0.045) * size)
        colour = _hsv(rng.uniform(0.0, 1.0), rng.uniform(0.6, 0.9), rng.uniform(0.7, 0.95))
        opacity = rng.uniform(0.45, 0.75)
        win = _window(cx, cy, length / 2 + width, size)
        if win is None:
            return
        region, dy, dx = win
        u = dx * math.cos(theta) + dy * math.sin(theta)
        v = -dx * math.sin(theta) + dy * math.cos(theta)
        alpha = opacity * (
            np.clip(length / 2 - np.abs(u) + 0.5, 0.0, 1.0)
            * np.clip(width / 2 - np.abs(v) + 0.5, 0.0, 1.0)
        )
        paint = np.broadcast_to(colour, (*alpha.shape, 3))
    else:  # an oily stain: a soft, dark ellipse
        a, b = rng.uniform(0.03, 0.09, 2) * size
        colour = _hsv(rng.uniform(0.05, 0.12), rng.uniform(0.3, 0.6), rng.uniform(0.1, 0.3))
        opacity = rng.uniform(0.15, 0.4)
        win = _window(cx, cy, max(a, b) + 1, size)
        if win is None:
            return
        region, dy, dx = win
        u = dx * math.cos(theta) + dy * math.sin(theta)
        v = -dx * math.sin(theta) + dy * math.cos(theta)
        alpha = opacity * np.clip((1.0 - (u / a) ** 2 - (v / b) ** 2) / 0.4, 0.0, 1.0)
        paint = np.broadcast_to(colour, (*alpha.shape, 3))
    a3 = alpha[..., None]
    canvas[region] = canvas[region] * (1.0 - a3) + paint * a3


def _glyph(scan: np.ndarray, rng: np.random.Generator, side: float, max_tilt: float) -> np.ndarray:
    """One scan as ink coverage, cropped to the tight box of its ink pixels."""
    aspect = rng.uniform(0.85, 1.15)
    w = max(_MIN_SIDE_PX, round(side * math.sqrt(aspect)))
    h = max(_MIN_SIDE_PX, round(side / math.sqrt(aspect)))
    img = Image.fromarray(np.ascontiguousarray(scan, dtype=np.float32))
    img = img.resize((w, h), Image.Resampling.BICUBIC)
    tilt = rng.uniform(-max_tilt, max_tilt)
    if tilt:
        img = img.rotate(tilt, resample=Image.Resampling.BILINEAR, expand=True)
    # As in the classification scenario: a contrast stretch makes the bicubic halo of
    # an 8x8 scan read as ink rather than smudge.
    glyph = np.clip((np.asarray(img, dtype=np.float32) - 0.1) * 1.3, 0.0, 1.0)
    glyph *= rng.uniform(0.85, 1.0)
    ink = glyph >= INK_THRESHOLD
    rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
    if not rows.size:
        return np.zeros((0, 0), dtype=np.float32)
    return glyph[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]


def _outline(glyph: np.ndarray, x0: int, y0: int) -> np.ndarray:
    """Convex hull (x, y) of the ink pixels' corners, in frame coordinates."""
    ink = glyph >= INK_THRESHOLD
    rows = np.flatnonzero(ink.any(axis=1))
    left = ink[rows].argmax(axis=1)
    right = ink.shape[1] - ink[rows, ::-1].argmax(axis=1)  # one past the last ink column
    y = rows.astype(np.float64)
    pts = np.concatenate(
        [np.stack([xs, ys], axis=1) for xs in (left, right) for ys in (y, y + 1.0)]
    ).astype(np.float64)
    # A degenerate set keeps every point: its bounds are still right.
    with contextlib.suppress(QhullError):
        pts = pts[ConvexHull(pts).vertices]
    return (pts + np.array([x0, y0], dtype=np.float64)).astype(np.float32)


def _pack_outlines(outlines: list[np.ndarray]) -> np.ndarray:
    """Per-object point lists as one [k, P, 2] array, shorter lists padded by repetition."""
    if not outlines:
        return np.zeros((0, 0, 2), dtype=np.float32)
    p = max(len(o) for o in outlines)
    return np.stack([np.concatenate([o, np.repeat(o[-1:], p - len(o), axis=0)]) for o in outlines])


@dataclass
class _Scene:
    frame: np.ndarray  # uint8 [S, S, 3]
    mask: np.ndarray  # uint8 [S, S]
    boxes: np.ndarray
    classes: np.ndarray
    visible: np.ndarray
    outlines: np.ndarray
    sources: np.ndarray


def _render_scene(
    rng: np.random.Generator, sources: DigitSources, pool: np.ndarray, config: SceneConfig
) -> _Scene:
    size = config.frame_size
    canvas = conveyor_background(rng, size)
    for _ in range(int(rng.integers(config.distractor_range[0], config.distractor_range[1] + 1))):
        _draw_distractor(canvas, rng)
    coverage = np.zeros((size, size), dtype=np.float32)
    count = int(rng.choice(len(config.count_weights), p=np.asarray(config.count_weights)))
    picks = rng.choice(pool, size=min(count, len(pool)), replace=False)
    boxes: list[tuple[int, int, int, int]] = []
    classes: list[int] = []
    outlines: list[np.ndarray] = []
    chosen: list[int] = []
    for src in picks:
        side = max(float(_MIN_SIDE_PX), rng.uniform(*config.scale_range) * size)
        glyph = _glyph(sources.images[src], rng, side, config.max_tilt_degrees)
        h, w = glyph.shape
        if not h or h > size or w > size:
            continue
        ink = _hsv(rng.uniform(0.0, 1.0), rng.uniform(0.0, 0.3), rng.uniform(0.05, 0.25))
        for _ in range(_PLACEMENT_TRIES):
            y0 = int(rng.integers(0, size - h + 1))
            x0 = int(rng.integers(0, size - w + 1))
            box = (x0, y0, x0 + w, y0 + h)
            if box_visibility(np.array([*boxes, box])).min() >= config.min_visible:
                break
        else:
            continue  # no room left for this one without hiding too much
        region = (slice(y0, y0 + h), slice(x0, x0 + w))
        alpha = glyph[..., None]
        canvas[region] = canvas[region] * (1.0 - alpha) + ink * alpha
        coverage[region] = 1.0 - (1.0 - coverage[region]) * (1.0 - glyph)
        boxes.append(box)
        classes.append(int(sources.labels[src]))
        outlines.append(_outline(glyph, x0, y0))
        chosen.append(int(src))
    canvas *= rng.uniform(0.92, 1.08)  # the plant's lights are never quite constant
    box_arr = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    return _Scene(
        frame=np.clip(np.rint(canvas), 0, 255).astype(np.uint8),
        mask=np.clip(np.rint(coverage * 255.0), 0, 255).astype(np.uint8),
        boxes=box_arr,
        classes=np.asarray(classes, dtype=np.int64),
        visible=box_visibility(box_arr),
        outlines=_pack_outlines(outlines),
        sources=np.asarray(chosen, dtype=np.int64),
    )


@functools.lru_cache(maxsize=4)
def render_scenes(split: Split, config: SceneConfig = SceneConfig()) -> DetectionSet:
    """All frames of one split with their boxes; cached per process and read-only."""
    if split not in _SPLIT_CODE:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    sources = load_digit_sources()
    pool = split_indices(sources.labels, config.split_fractions, config.seed)[split]
    n = config.frame_count(split)
    size = config.frame_size
    frames = np.empty((n, size, size, 3), dtype=np.uint8)
    masks = np.empty((n, size, size), dtype=np.uint8)
    scenes: list[_Scene] = []
    for i in range(n):
        # A generator per frame: a frame does not change when the frame count does.
        rng = np.random.default_rng([config.seed, _SPLIT_CODE[split], i, _SCENE_SALT])
        scene = _render_scene(rng, sources, pool, config)
        frames[i], masks[i] = scene.frame, scene.mask
        scenes.append(scene)
    frames.setflags(write=False)
    masks.setflags(write=False)
    for s in scenes:
        for arr in (s.boxes, s.classes, s.visible, s.outlines, s.sources):
            arr.setflags(write=False)
    params = hashlib.sha256(repr(sorted(config.as_dict().items())).encode()).hexdigest()[:12]
    return DetectionSet(
        frames=frames,
        boxes=[s.boxes for s in scenes],
        classes=[s.classes for s in scenes],
        class_names=DIGIT_CLASSES,
        visible=[s.visible for s in scenes],
        masks=masks,
        outlines=[s.outlines for s in scenes],
        sources=[s.sources for s in scenes],
        identity=f"{sources.identity}/scenes:{params}/{split}",
        notes={"split": split, "frames": n, "scans": len(pool)},
    )
