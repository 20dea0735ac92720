"""Distribution shift on detection scenes, with the ground truth kept true.

Every named drift of ``distill.drift`` applies to a ``DetectionSet``, at the same
severity scale and in the same physical order (``DRIFT_ORDER``):

- ``lighting``, ``blur``, ``noise`` and ``jpeg`` change pixels only; boxes stay.
- ``background`` swaps the belt under the objects: the set's object mask keeps the
  digits in front, so their boxes stay. Clutter is part of the belt and goes with it.
- ``rotation`` twists the camera mount about the frame centre, up to
  ``ROTATION_MAX_DEGREES`` at severity 1 in either direction. Each object's ink
  outline turns with the same angle and centre as the pixels; its new box is the
  axis-aligned bounds of the turned outline (the turned corners of the old box when
  a set has no outlines), clipped to the frame and, when the set has an object mask,
  cut down to the turned ink inside it, so a box stays tight around ink pixels as
  in a clean render. An object turned mostly out of view
  (under ``MIN_IN_FRAME`` of its box left in the frame) is dropped; ``visible`` is
  recomputed from the new boxes and the part cut off by the frame edge.

Frame ``i`` draws from generators derived from (seed, i) exactly as
``distill.drift.apply_drift_frame`` does, so a severity sweep makes the same effect
stronger, and severity 0 leaves frames and boxes as they were.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import ndimage

from distill.drift import (
    DRIFT_ORDER,
    Drift,
    DriftSpecError,
    apply_drift_frame,
    format_drift_spec,
    parse_drift_spec,
    random_drift_spec,
)
from distill.scenes import INK_THRESHOLD, DetectionSet, box_visibility

__all__ = [
    "MIN_IN_FRAME",
    "ROTATION_MAX_DEGREES",
    "apply_scene_drift",
    "random_scene_drifts",
    "rotation_angle",
]

# Same scale as distill.drift's rotation (DRIFT_KINDS["rotation"] documents it).
ROTATION_MAX_DEGREES = 30.0
# Least fraction of a turned object's box that must stay in the frame for it to be kept.
MIN_IN_FRAME = 0.4


def rotation_angle(severity: float, seed: int, index: int) -> float:
    """Degrees frame ``index`` turns by at ``severity`` (positive: clockwise on screen)."""
    rng = np.random.default_rng([seed, index, DRIFT_ORDER.index("rotation")])
    sign = float(rng.choice([-1.0, 1.0]))
    return sign * severity * ROTATION_MAX_DEGREES


def _turn(theta: float) -> np.ndarray:
    """The (row, col) matrix mapping output pixel offsets to input ones, as ndimage wants."""
    return np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])


def _rotate_pixels(image: np.ndarray, angle: float, fill: np.ndarray | float) -> np.ndarray:
    """float32 [H, W] or [H, W, C] turned by ``angle`` degrees about the frame centre."""
    rot = _turn(math.radians(angle))
    centre = np.full(2, (image.shape[0] - 1) / 2.0)
    offset = centre - rot @ centre
    if image.ndim == 2:
        return ndimage.affine_transform(
            image, rot, offset=offset, order=1, mode="constant", cval=float(np.asarray(fill))
        )
    fills = np.broadcast_to(np.asarray(fill, dtype=np.float64), (image.shape[2],))
    out = np.empty_like(image)
    for c in range(image.shape[2]):
        out[..., c] = ndimage.affine_transform(
            image[..., c], rot, offset=offset, order=1, mode="constant", cval=float(fills[c])
        )
    return out


def _rotate_points(points: np.ndarray, angle: float, size: int) -> np.ndarray:
    """(x, y) points in pixel-edge coordinates moved as ``_rotate_pixels`` moves pixels."""
    theta = math.radians(angle)
    c, s = math.cos(theta), math.sin(theta)
    half = size / 2.0  # the centre pixel's centre, in edge coordinates
    dx, dy = points[..., 0] - half, points[..., 1] - half
    # ndimage samples input = R @ output; a point therefore moves by R's transpose.
    y = c * dy + s * dx + half
    x = -s * dy + c * dx + half
    return np.stack([x, y], axis=-1).astype(np.float32)


def _box_corners(boxes: np.ndarray) -> np.ndarray:
    x1, y1, x2, y2 = (boxes[:, j] for j in range(4))
    return np.stack(
        [
            np.stack([x1, y1], 1),
            np.stack([x2, y1], 1),
            np.stack([x2, y2], 1),
            np.stack([x1, y2], 1),
        ],
        axis=1,
    ).astype(np.float32)


def _shrink_to_ink(boxes: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Each box cut down to the bounds of the ink inside it (kept as is where it holds none).

    The turned outline bounds the turned ink; resampling softens the outermost ink
    pixels below ``INK_THRESHOLD``, so the ink itself can end a pixel or two inside.
    """
    out = boxes.copy()
    for j, (x1, y1, x2, y2) in enumerate(boxes):
        bx, by = math.floor(x1), math.floor(y1)
        ink = mask[by : math.ceil(y2), bx : math.ceil(x2)] >= INK_THRESHOLD
        rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
        if rows.size:
            inked = (bx + cols[0], by + rows[0], bx + cols[-1] + 1, by + rows[-1] + 1)
            out[j, :2] = np.maximum(boxes[j, :2], inked[:2])
            out[j, 2:] = np.minimum(boxes[j, 2:], inked[2:])
    return out


def _rotate_objects(
    ds: DetectionSet, i: int, angle: float, mask: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """New (boxes, classes, visible, outlines, sources) of frame ``i`` turned by ``angle``.

    ``mask`` is the frame's turned ink coverage in [0, 1], when known.
    """
    size = ds.frame_size
    boxes = ds.boxes[i]
    polys = ds.outlines[i] if ds.outlines is not None else _box_corners(boxes)
    turned = _rotate_points(polys, angle, size) if len(boxes) else polys
    if len(boxes):
        raw = np.concatenate([turned.min(axis=1), turned.max(axis=1)], axis=1)
    else:
        raw = np.zeros((0, 4), dtype=np.float32)
    clipped = np.clip(raw, 0.0, float(size)).astype(np.float32)
    w, h = clipped[:, 2] - clipped[:, 0], clipped[:, 3] - clipped[:, 1]
    raw_area = np.maximum((raw[:, 2] - raw[:, 0]) * (raw[:, 3] - raw[:, 1]), 1e-6)
    in_frame = w * h / raw_area
    keep = (w >= 1.0) & (h >= 1.0) & (in_frame >= MIN_IN_FRAME)
    new_boxes = clipped[keep]
    if mask is not None:
        new_boxes = _shrink_to_ink(new_boxes, mask)
    visible = (box_visibility(new_boxes) * in_frame[keep]).astype(np.float32)
    outlines = turned[keep] if ds.outlines is not None else None
    sources = ds.sources[i][keep] if ds.sources is not None else None
    return new_boxes, ds.classes[i][keep], visible, outlines, sources


def _ordered(spec: Sequence[Drift] | str) -> tuple[Drift, ...]:
    if isinstance(spec, str):
        return parse_drift_spec(spec)
    names = [d.name for d in spec]
    if len(set(names)) != len(names):
        raise DriftSpecError(f"a drift is given twice in {format_drift_spec(spec)}")
    return tuple(sorted(spec, key=lambda d: DRIFT_ORDER.index(d.name)))


def apply_scene_drift(ds: DetectionSet, spec: Sequence[Drift] | str, seed: int = 0) -> DetectionSet:
    """Every frame of ``ds`` through the spec, boxes moved where the drift moves objects.

    ``spec`` is a drift spec or its text (``"rotation:0.5,noise:1"``). With an empty
    spec ``ds`` itself is returned.
    """
    drifts = _ordered(spec)
    if not drifts:
        return ds
    rot_pos = DRIFT_ORDER.index("rotation")
    before = tuple(d for d in drifts if DRIFT_ORDER.index(d.name) < rot_pos)
    after = tuple(d for d in drifts if DRIFT_ORDER.index(d.name) > rot_pos)
    rotation = next((d.severity for d in drifts if d.name == "rotation"), 0.0)
    n = len(ds)
    frames = np.empty_like(ds.frames)
    masks = ds.masks if ds.masks is None or rotation == 0.0 else ds.masks.copy()
    boxes, classes = list(ds.boxes), list(ds.classes)
    visible = None if ds.visible is None else list(ds.visible)
    outlines = None if ds.outlines is None else list(ds.outlines)
    sources = None if ds.sources is None else list(ds.sources)
    for i in range(n):
        frame = ds.frames[i]
        mask = None if masks is None else masks[i].astype(np.float32) / 255.0
        if before:
            frame = apply_drift_frame(frame, before, (seed, i), mask)
        angle = rotation_angle(rotation, seed, i)
        if angle != 0.0:
            pixels = frame.astype(np.float32)
            border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
            turned = _rotate_pixels(pixels, angle, np.median(border, axis=0))
            frame = np.clip(np.rint(turned), 0, 255).astype(np.uint8)
            if masks is not None and mask is not None:
                mask = np.clip(_rotate_pixels(mask, angle, 0.0), 0.0, 1.0)
                masks[i] = np.rint(mask * 255.0).astype(np.uint8)
            b, c, v, o, s = _rotate_objects(ds, i, angle, mask)
            boxes[i], classes[i] = b, c
            if visible is not None:
                visible[i] = v
            if outlines is not None and o is not None:
                outlines[i] = o
            if sources is not None and s is not None:
                sources[i] = s
        if after:
            frame = apply_drift_frame(frame, after, (seed, i), mask)
        frames[i] = frame
    frames.setflags(write=False)
    if masks is not None:
        masks.setflags(write=False)
    return DetectionSet(
        frames=frames,
        boxes=boxes,
        classes=classes,
        class_names=ds.class_names,
        visible=visible,
        masks=masks,
        outlines=outlines,
        sources=sources,
        identity=f"{ds.identity}/drift:{format_drift_spec(drifts)}@{seed}",
        notes={**ds.notes, "drift": format_drift_spec(drifts), "drift_seed": seed},
    )


def random_scene_drifts(ds: DetectionSet, seed: int, *, max_drifts: int = 2) -> DetectionSet:
    """Each frame of ``ds`` under its own random mix of 1..``max_drifts`` named drifts.

    A training view for drift augmentation: the mixes and severities come from
    ``distill.drift.random_drift_spec`` (as the classifier teacher's augmentation),
    drawn from ``seed``; boxes move with their objects as in ``apply_scene_drift``.
    """
    rng = np.random.default_rng([seed, 31])
    parts = []
    for i in range(len(ds)):
        spec = random_drift_spec(rng, p_clean=0.0, max_drifts=max_drifts)
        parts.append(apply_scene_drift(ds.subset(i), spec, seed=int(rng.integers(0, 2**31))))
    frames = np.concatenate([p.frames for p in parts])
    frames.setflags(write=False)

    def joined(name: str) -> list[np.ndarray] | None:
        if getattr(ds, name) is None:
            return None
        return [getattr(p, name)[0] for p in parts]

    return DetectionSet(
        frames=frames,
        boxes=[p.boxes[0] for p in parts],
        classes=[p.classes[0] for p in parts],
        class_names=ds.class_names,
        visible=joined("visible"),
        masks=None if ds.masks is None else np.concatenate([p.masks for p in parts]),
        outlines=joined("outlines"),
        sources=joined("sources"),
        identity=f"{ds.identity}/random-drifts@{seed}",
        notes={**ds.notes, "drift": "random", "drift_seed": seed},
    )
