from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from distill.drift import DRIFT_KINDS, DRIFT_NAMES, Drift, DriftSpecError
from distill.scenario import DIGIT_CLASSES, SPLITS, load_digit_sources, split_indices
from distill.scene_drift import (
    ROTATION_MAX_DEGREES,
    apply_scene_drift,
    random_scene_drifts,
    rotation_angle,
)
from distill.scenes import INK_THRESHOLD, DetectionSet, SceneConfig, box_visibility, render_scenes

# Bypass the per-process cache to see what a fresh render produces.
_render = render_scenes.__wrapped__
_SMALL = SceneConfig(frame_size=160, eval_frames=120)
_INK = round(INK_THRESHOLD * 255)


@pytest.fixture(scope="module")
def scenes() -> DetectionSet:
    return _render("validation", _SMALL)


@pytest.fixture(scope="module")
def few(scenes: DetectionSet) -> DetectionSet:
    return scenes.subset(slice(0, 24))


def _cover(boxes: np.ndarray, size: int, pad: int = 0) -> np.ndarray:
    """Boolean [size, size]: pixels inside any box grown by ``pad`` pixels."""
    out = np.zeros((size, size), dtype=bool)
    for x1, y1, x2, y2 in boxes:
        y0, x0 = max(0, int(np.floor(y1)) - pad), max(0, int(np.floor(x1)) - pad)
        out[y0 : int(np.ceil(y2)) + pad, x0 : int(np.ceil(x2)) + pad] = True
    return out


def test_config_refuses_bad_values() -> None:
    for bad in (
        {"frame_size": 16},
        {"split_fractions": (0.5, 0.5, 0.1, 0.1)},
        {"count_weights": (0.5, 0.6)},
        {"scale_range": (0.3, 0.1)},
        {"min_visible": 0.0},
        {"distractor_range": (3, 1)},
        {"eval_frames": 0},
    ):
        with pytest.raises(ValueError):
            SceneConfig(**bad)  # type: ignore[arg-type]
    assert SceneConfig().as_dict()["frame_size"] == 320
    assert SceneConfig().max_objects == 6


def test_rendering_is_deterministic_per_seed() -> None:
    config = SceneConfig(frame_size=160, eval_frames=12)
    a, b = _render("test", config), _render("test", config)
    c = _render("test", SceneConfig(frame_size=160, eval_frames=12, seed=1))
    assert a.frames.tobytes() == b.frames.tobytes()
    assert a.masks is not None and b.masks is not None
    assert a.masks.tobytes() == b.masks.tobytes()
    for x, y in zip(a.boxes, b.boxes, strict=True):
        assert x.tobytes() == y.tobytes()
    for x, y in zip(a.classes, b.classes, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.frames, c.frames)
    assert a.identity == b.identity != c.identity


def test_a_frame_does_not_depend_on_the_frame_count() -> None:
    short = _render("test", SceneConfig(frame_size=64, eval_frames=5))
    long = _render("test", SceneConfig(frame_size=64, eval_frames=9))
    np.testing.assert_array_equal(short.frames, long.frames[:5])


def test_splits_never_share_a_source_scan() -> None:
    config = SceneConfig(frame_size=64, train_frames=60, eval_frames=60, stream_frames=60)
    pools = split_indices(load_digit_sources().labels, config.split_fractions, config.seed)
    used: dict[str, set[int]] = {}
    for split in SPLITS:
        ds = _render(split, config)
        assert ds.sources is not None
        used[split] = {int(s) for srcs in ds.sources for s in srcs}
        assert used[split] <= set(pools[split].tolist())
        labels = load_digit_sources().labels
        for srcs, cls in zip(ds.sources, ds.classes, strict=True):
            np.testing.assert_array_equal(labels[srcs], cls)
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                assert not used[a] & used[b], (a, b)


def test_object_counts_span_empty_to_six(scenes: DetectionSet) -> None:
    counts = scenes.object_counts()
    assert counts.min() == 0 and counts.max() <= 6
    assert 0 < (counts == 0).sum() < len(scenes) // 4  # some empty frames, not many
    assert (counts >= 4).sum() > 0
    assert sum(scenes.class_counts().values()) == counts.sum()


def test_boxes_are_valid(scenes: DetectionSet) -> None:
    size = scenes.frame_size
    assert scenes.frames.shape == (len(scenes), 160, 160, 3)
    assert scenes.frames.dtype == np.uint8
    assert scenes.class_names == DIGIT_CLASSES
    for boxes, classes in zip(scenes.boxes, scenes.classes, strict=True):
        assert boxes.dtype == np.float32 and classes.dtype == np.int64
        assert boxes.shape == (len(classes), 4)
        if len(boxes):
            assert (boxes >= 0).all() and (boxes[:, 2:] <= size).all()
            assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
            assert ((boxes[:, 2:] - boxes[:, :2]) >= 3).all()
            assert classes.min() >= 0 and classes.max() <= 9


def test_boxes_are_tight_around_the_drawn_ink(scenes: DetectionSet) -> None:
    assert scenes.masks is not None
    for i in range(len(scenes)):
        mask, frame = scenes.masks[i], scenes.frames[i].astype(np.float32).mean(axis=2)
        cover = _cover(scenes.boxes[i], scenes.frame_size)
        # Nothing is drawn outside the boxes: a box on an empty region would be absent
        # and ink outside every box would be an unlabelled object.
        assert not mask[~cover].any(), i
        for x1, y1, x2, y2 in scenes.boxes[i].astype(int):
            box = mask[y1:y2, x1:x2]
            # Ink reaches every side of the box.
            for edge in (box[0], box[-1], box[:, 0], box[:, -1]):
                assert edge.max() >= _INK - 1
            # The digit's ink is darker than the belt around it.
            inked = frame[y1:y2, x1:x2][box >= 200]
            belt = frame[~cover]
            assert inked.size and belt.size
            assert inked.mean() < belt.mean() - 20


def test_occlusion_keeps_every_box_visible_enough(scenes: DetectionSet) -> None:
    assert scenes.visible is not None
    overlapped = 0
    for boxes, visible in zip(scenes.boxes, scenes.visible, strict=True):
        assert visible.dtype == np.float32
        assert (visible >= _SMALL.min_visible - 1e-6).all() and (visible <= 1.0).all()
        np.testing.assert_allclose(visible, box_visibility(boxes))
        overlapped += int((visible < 1.0).sum())
    assert overlapped > 0  # objects do overlap sometimes


def test_box_visibility_counts_only_boxes_drawn_later() -> None:
    boxes = np.array([[0, 0, 10, 10], [5, 0, 15, 10], [0, 5, 10, 10], [20, 20, 30, 30]], float)
    # Box 0 is covered by box 1 (right half) and box 2 (bottom half): 75% hidden.
    np.testing.assert_allclose(box_visibility(boxes), [0.25, 0.75, 1.0, 1.0])
    assert box_visibility(np.zeros((0, 4))).shape == (0,)


def test_other_frame_sizes_work() -> None:
    for size, n in ((64, 30), (320, 3)):
        ds = _render("test", SceneConfig(frame_size=size, eval_frames=n))
        assert ds.frames.shape == (n, size, size, 3)
        for boxes in ds.boxes:
            if len(boxes):
                assert (boxes >= 0).all() and (boxes[:, 2:] <= size).all()
                assert ((boxes[:, 2:] - boxes[:, :2]) >= 3).all()


def test_subset_keeps_frames_and_boxes_aligned(scenes: DetectionSet) -> None:
    pick = np.array([5, 1, 7])
    sub = scenes.subset(pick)
    assert len(sub) == 3 and sub.masks is not None and scenes.masks is not None
    for j, i in enumerate(pick):
        np.testing.assert_array_equal(sub.frames[j], scenes.frames[i])
        np.testing.assert_array_equal(sub.masks[j], scenes.masks[i])
        np.testing.assert_array_equal(sub.boxes[j], scenes.boxes[i])
        np.testing.assert_array_equal(sub.classes[j], scenes.classes[i])
    assert len(scenes.subset(scenes.object_counts() == 0)) == (scenes.object_counts() == 0).sum()


def test_detection_set_refuses_mismatched_ground_truth(few: DetectionSet) -> None:
    with pytest.raises(ValueError):
        DetectionSet(few.frames, few.boxes[:-1], few.classes, DIGIT_CLASSES)
    boxes = list(few.boxes)
    boxes[0] = np.zeros((len(few.classes[0]) + 1, 4), np.float32)
    with pytest.raises(ValueError):
        DetectionSet(few.frames, boxes, few.classes, DIGIT_CLASSES)


@pytest.mark.parametrize("name", DRIFT_NAMES)
def test_severity_zero_is_identity(few: DetectionSet, name: str) -> None:
    out = apply_scene_drift(few, (Drift(name, 0.0),), seed=5)
    np.testing.assert_array_equal(out.frames, few.frames)
    for a, b in zip(out.boxes, few.boxes, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(out.classes, few.classes, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", DRIFT_NAMES)
def test_drift_changes_pixels_and_keeps_boxes_unless_it_turns_them(
    few: DetectionSet, name: str
) -> None:
    out = apply_scene_drift(few, f"{name}:1", seed=5)
    assert out.frames.shape == few.frames.shape and out.frames.dtype == np.uint8
    diff = np.abs(out.frames.astype(np.int16) - few.frames.astype(np.int16)).mean(axis=(1, 2, 3))
    assert (diff > 2.0).all(), diff
    moved = [not np.array_equal(a, b) for a, b in zip(out.boxes, few.boxes, strict=True)]
    if name == "rotation":
        assert sum(moved) == sum(len(b) > 0 for b in few.boxes)  # every non-empty frame
    else:
        assert not any(moved)
        for a, b in zip(out.classes, few.classes, strict=True):
            np.testing.assert_array_equal(a, b)
    again = apply_scene_drift(few, (Drift(name, 1.0),), seed=5)
    np.testing.assert_array_equal(again.frames, out.frames)


def test_background_swap_keeps_the_objects_in_front(few: DetectionSet) -> None:
    out = apply_scene_drift(few, "background:1", seed=2)
    assert few.masks is not None
    solid = few.masks >= 250
    belt = few.masks == 0
    change = np.abs(out.frames.astype(np.int16) - few.frames.astype(np.int16)).max(axis=3)
    assert change[solid].max() <= 6  # the ink itself stays (up to the 2% belt in it)
    assert change[belt].mean() > 20  # the belt under it is new


def test_rotation_boxes_hold_the_turned_ink(few: DetectionSet) -> None:
    out = apply_scene_drift(few, "rotation:1", seed=9)
    assert few.masks is not None and out.masks is not None and out.visible is not None
    size = few.frame_size
    checked = 0
    for i in range(len(few)):
        angle = rotation_angle(1.0, 9, i)
        assert abs(angle) == ROTATION_MAX_DEGREES
        # The clean mask turned independently (PIL turns counter-clockwise on screen).
        turned = np.asarray(
            Image.fromarray(few.masks[i]).rotate(-angle, resample=Image.Resampling.BILINEAR)
        )
        boxes = out.boxes[i]
        assert (boxes >= 0).all() and (boxes[:, 2:] <= size).all()
        assert ((out.visible[i] >= 0) & (out.visible[i] <= 1)).all()
        if len(boxes) != len(few.boxes[i]):
            continue  # an object turned out of view was dropped; its ink may remain
        checked += 1
        cover = _cover(boxes, size, pad=1)
        assert not (turned >= 128)[~cover].any(), i
        assert not (out.masks[i] >= 128)[~cover].any(), i
    assert checked >= len(few) // 2


def test_rotated_box_is_tight_around_a_lone_object() -> None:
    config = SceneConfig(frame_size=160, eval_frames=16, count_weights=(0.0, 1.0))
    clean = _render("test", config)
    assert clean.masks is not None
    out = apply_scene_drift(clean, "rotation:0.8", seed=1)
    checked = 0
    for i in range(len(out)):
        if len(out.boxes[i]) != 1:
            continue
        checked += 1
        angle = rotation_angle(0.8, 1, i)
        turned = Image.fromarray(clean.masks[i]).rotate(-angle, resample=Image.Resampling.BILINEAR)
        ink = np.argwhere(np.asarray(turned) >= _INK)
        x1, y1, x2, y2 = out.boxes[i][0]
        # The independently turned ink spans the box to within a pixel on every side.
        assert abs(ink[:, 1].min() - x1) <= 1 and abs(ink[:, 1].max() + 1 - x2) <= 1
        assert abs(ink[:, 0].min() - y1) <= 1 and abs(ink[:, 0].max() + 1 - y2) <= 1
    assert checked >= 12


def test_rotation_without_outlines_turns_box_corners(few: DetectionSet) -> None:
    bare = DetectionSet(few.frames, few.boxes, few.classes, few.class_names, masks=few.masks)
    loose = apply_scene_drift(bare, "rotation:1", seed=9)
    tight = apply_scene_drift(few, "rotation:1", seed=9)
    for a, b in zip(loose.boxes, tight.boxes, strict=True):
        if len(a) == len(b) and len(a):
            assert (a[:, :2] <= b[:, :2] + 1e-3).all() and (a[:, 2:] >= b[:, 2:] - 1e-3).all()


def test_drift_specs_compose_and_are_checked(few: DetectionSet) -> None:
    text = apply_scene_drift(few, "noise:0.5,rotation:0.5", seed=4)
    spec = apply_scene_drift(few, (Drift("rotation", 0.5), Drift("noise", 0.5)), seed=4)
    np.testing.assert_array_equal(text.frames, spec.frames)
    assert apply_scene_drift(few, "none") is few
    with pytest.raises(DriftSpecError):
        apply_scene_drift(few, (Drift("blur", 0.5), Drift("blur", 0.2)))
    assert f"{ROTATION_MAX_DEGREES:g} degrees" in DRIFT_KINDS["rotation"].description


def test_random_scene_drifts_give_each_frame_its_own_mix(few: DetectionSet) -> None:
    view = random_scene_drifts(few, seed=3)
    again = random_scene_drifts(few, seed=3)
    np.testing.assert_array_equal(view.frames, again.frames)
    assert not np.array_equal(view.frames, random_scene_drifts(few, seed=4).frames)
    assert len(view) == len(few) and view.frames.shape == few.frames.shape
    # Every frame drifts (no clean picks), each by its own amount.
    change = np.abs(view.frames.astype(np.int16) - few.frames.astype(np.int16)).mean(axis=(1, 2, 3))
    assert (change > 0).all() and len(np.unique(np.round(change, 3))) > len(few) // 2
    # Classes stay with their frames; a rotation may move boxes or drop one turned out of view.
    for before, after, b in zip(few.classes, view.classes, view.boxes, strict=True):
        assert set(after.tolist()) <= set(before.tolist()) and b.shape == (len(after), 4)
        assert ((b >= 0) & (b <= few.frame_size)).all()
