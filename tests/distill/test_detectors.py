"""The reference detectors: training, export, INT8, COCO scoring and the cache.

The quick pair is built once per module (it is the slow part) and shared by the tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from distill.detector_cache import (
    DetectorReferenceConfig,
    ReferenceDetectors,
    bootstrap_reference_detectors,
)
from distill.detector_eval import OnnxDetector, coco_metrics, evaluate_under_drift
from distill.detector_export import detections_diff
from distill.detector_train import (
    DetTrainConfig,
    FrameBoxes,
    build_targets,
    labels_from_set,
    merge_labels,
    pseudo_labels,
    train_detector,
)
from distill.detectors import MAX_DETECTIONS, detector_profile, load_detector, net_detections
from distill.scene_drift import random_scene_drifts
from distill.scenes import DetectionSet, render_scenes
from shared.errors import DataError, ModelError
from shared.tasks import DETECTION
from shared.tasks.detection import average_precision

QUICK = DetectorReferenceConfig.reference(quick=True)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def det_cache(model_cache: Path) -> Path:
    return model_cache  # shared with every test of the quick pair, across runs


@pytest.fixture(scope="module")
def quick_pair(quick_detectors: ReferenceDetectors) -> ReferenceDetectors:
    return quick_detectors


@pytest.fixture(scope="module")
def quick_test() -> DetectionSet:
    return render_scenes("test", QUICK.scenario)


def _tiny_set() -> DetectionSet:
    return render_scenes("train", QUICK.scenario).subset(slice(0, 12))


# --- the pair ------------------------------------------------------------------------


def test_pair_is_built_and_scored(quick_pair: ReferenceDetectors) -> None:
    assert set(quick_pair.built) <= {"teacher", "student"}  # nothing when cached before
    for path in (
        quick_pair.teacher_pt,
        quick_pair.teacher_onnx,
        quick_pair.student_pt,
        quick_pair.student_onnx,
        quick_pair.student_int8_onnx,
        quick_pair.metrics_json,
    ):
        assert path.is_file() and path.stat().st_size > 0
    m = json.loads(quick_pair.metrics_json.read_text())
    assert (
        m["params"] < m["teacher"]["params"]
        and m["macs_per_frame"] < m["teacher"]["macs_per_frame"]
    )
    # Well above chance on the quick set, for teacher and student alike.
    assert m["teacher"]["test"]["map50"] > 0.5
    assert m["test"]["map50"] > 0.4
    for key in ("test", "int8_test"):
        assert 0.0 < m[key]["map50_95"] < m[key]["map50"] <= 1.0
    assert m["train"]["pseudo_frames"] == QUICK.pseudo_frames


def test_exported_student_matches_torch(
    quick_pair: ReferenceDetectors, quick_test: DetectionSet
) -> None:
    loaded = load_detector(quick_pair.student_pt)
    frames = quick_test.frames[:16]
    expected = net_detections(loaded.net, frames, loaded.meta.num_classes)
    got = OnnxDetector(quick_pair.student_onnx).detections(frames)
    assert detections_diff(got, expected) < 1e-4
    confident = expected[:, :, 4] >= 0.3
    assert confident.any()
    # The same top detections, in the same order.
    top = 3
    np.testing.assert_array_equal(got[:, :top, 5], expected[:, :top, 5])
    np.testing.assert_allclose(got[:, :top, :5], expected[:, :top, :5], atol=1e-4)


def test_output_contract(quick_pair: ReferenceDetectors, quick_test: DetectionSet) -> None:
    model = onnx.load(str(quick_pair.student_onnx))
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["edgeloop.task"] == "detection" and meta["edgeloop.precision"] == "fp32"
    assert json.loads(meta["edgeloop.labels"]) == list(quick_test.class_names)
    assert int(meta["edgeloop.frame_size"]) == quick_test.frame_size
    assert meta["edgeloop.name"] and meta["edgeloop.version"]
    (inp,) = model.graph.input
    dims = inp.type.tensor_type.shape.dim
    assert inp.name == "frames" and inp.type.tensor_type.elem_type == onnx.TensorProto.UINT8
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [160, 160, 3]
    assert [o.name for o in model.graph.output] == ["detections"]

    detector = OnnxDetector(quick_pair.student_onnx)
    for batch in (1, 3):
        out = detector.detections(quick_test.frames[:batch])
        assert out.shape == (batch, MAX_DETECTIONS, 6) and out.dtype == np.float32
        boxes, scores, classes = out[..., :4], out[..., 4], out[..., 5]
        assert ((boxes >= 0) & (boxes <= 1)).all()
        assert (out[..., 2] >= out[..., 0]).all() and (out[..., 3] >= out[..., 1]).all()
        assert ((scores >= 0) & (scores <= 1)).all()
        assert (np.diff(scores, axis=1) <= 0).all()  # best first
        assert (classes == np.round(classes)).all() and (
            classes < len(quick_test.class_names)
        ).all()
        assert (out[scores == 0] == 0).all()  # padding rows are all zero
        answers = DETECTION.answers(out)
        assert len(answers) == batch
        assert all(b[4] >= DETECTION.score_threshold for a in answers for b in a.boxes)


def test_int8_student(quick_pair: ReferenceDetectors, quick_test: DetectionSet) -> None:
    model = onnx.load(str(quick_pair.student_int8_onnx))
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["edgeloop.precision"] == "int8" and meta["edgeloop.task"] == "detection"
    ops = [n.op_type for n in model.graph.node]
    assert "DequantizeLinear" in ops and "TopK" in ops
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    # The decode stays float: nothing quantized feeds the peak test or TopK.
    for node in model.graph.node:
        if node.op_type in ("MaxPool", "TopK", "Sigmoid"):
            assert producer.get(node.input[0]) not in ("QuantizeLinear", "DequantizeLinear")
    # Frames feed the first quantized convolution directly (the preprocessing is folded).
    assert json.loads(meta["edgeloop.quantization"])["folded_input"]

    fp32 = coco_metrics(
        OnnxDetector(quick_pair.student_onnx).detections(quick_test.frames), quick_test
    )
    int8 = coco_metrics(
        OnnxDetector(quick_pair.student_int8_onnx).detections(quick_test.frames), quick_test
    )
    assert abs(fp32.map50 - int8.map50) <= 0.03
    assert int8.map50 > 0.35


def test_cache_reuse_builds_nothing(quick_pair: ReferenceDetectors, det_cache: Path) -> None:
    files = [quick_pair.teacher_onnx, quick_pair.student_onnx, quick_pair.student_int8_onnx]
    before = {p: p.stat().st_mtime_ns for p in files}
    again = bootstrap_reference_detectors(det_cache, quick=True)
    assert again.built == ()
    assert {p: p.stat().st_mtime_ns for p in files} == before
    assert again.metrics == quick_pair.metrics
    names = {p.name for p in det_cache.iterdir()}
    assert {
        f"det-teacher-{quick_pair.teacher_key}",
        f"det-student-{quick_pair.student_key}",
    } <= names


def test_keys_follow_configuration() -> None:
    full = DetectorReferenceConfig.reference()
    assert QUICK.teacher_key() != full.teacher_key()
    assert QUICK.student_key() != full.student_key()
    assert QUICK.teacher_key() == DetectorReferenceConfig.reference(quick=True).teacher_key()
    # Threads do not change the weights, so they do not change the key.
    threads = replace(QUICK, teacher=QUICK.teacher.with_(threads=2))
    assert threads.teacher_key() == QUICK.teacher_key()
    assert replace(QUICK, pseudo_frames=7).student_key() != QUICK.student_key()


# --- scoring -------------------------------------------------------------------------


def test_coco_metrics_on_ground_truth_and_against_numpy(
    quick_pair: ReferenceDetectors, quick_test: DetectionSet
) -> None:
    size = quick_test.frame_size
    perfect = np.zeros((len(quick_test), MAX_DETECTIONS, 6), np.float32)
    for i, (b, c) in enumerate(zip(quick_test.boxes, quick_test.classes, strict=True)):
        perfect[i, : len(b), :4] = b / size
        perfect[i, : len(b), 4] = 1.0
        perfect[i, : len(b), 5] = c
    exact = coco_metrics(perfect, quick_test)
    assert exact.map50 == pytest.approx(1.0) and exact.map50_95 == pytest.approx(1.0)

    rows = OnnxDetector(quick_pair.student_onnx).detections(quick_test.frames)
    truth = [
        [(*(b / size).tolist(), 1.0, int(c)) for b, c in zip(bs, cs, strict=True)]
        for bs, cs in zip(quick_test.boxes, quick_test.classes, strict=True)
    ]
    predicted = [[tuple(r) for r in frame if r[4] > 0] for frame in rows.tolist()]
    assert coco_metrics(rows, quick_test).map50 == pytest.approx(
        average_precision(predicted, truth), abs=1e-6
    )


def test_evaluate_under_drift(quick_pair: ReferenceDetectors, quick_test: DetectionSet) -> None:
    subset = quick_test.subset(slice(0, 24))
    result = evaluate_under_drift(quick_pair.student_int8_onnx, subset, ["", "noise:1.0"])
    assert list(result) == ["", "noise:1.0"]
    assert all(0.0 <= m.map50 <= 1.0 and m.frames == 24 for m in result.values())
    assert result["noise:1.0"].objects == result[""].objects


# --- training ------------------------------------------------------------------------


def _tiny_config(**overrides: object) -> DetTrainConfig:
    base = DetTrainConfig(role="student", epochs=1, batch_size=6, frame_size=160, crop=96)
    return base.with_(**overrides)


def test_training_is_deterministic() -> None:
    ds = _tiny_set()
    labels = labels_from_set(ds)
    replay = (ds.frames[:4], labels[:4])

    def run(seed: int) -> dict[str, torch.Tensor]:
        cfg = _tiny_config(seed=seed, replay_share=0.25)
        result = train_detector(cfg, ds.frames, labels, class_names=ds.class_names, replay=replay)
        assert result.metrics["replay_frames"] == 4
        return result.net.state_dict()

    a, b, c = run(0), run(0), run(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_training_with_drifted_views() -> None:
    ds = _tiny_set()
    view = random_scene_drifts(ds, seed=0)
    views = [(view.frames, labels_from_set(view))]
    cfg = _tiny_config(drift_views=1, p_clean=0.0)
    shown = train_detector(
        cfg, ds.frames, labels_from_set(ds), class_names=ds.class_names, views=views
    )
    clean = train_detector(
        cfg.with_(drift_views=0), ds.frames, labels_from_set(ds), class_names=ds.class_names
    )
    assert shown.metrics["drift_views"] == 1 and clean.metrics["drift_views"] == 0
    a, b = shown.net.state_dict(), clean.net.state_dict()
    assert not all(torch.equal(a[k], b[k]) for k in a)
    # Shown clean every time, the drifted view changes nothing.
    always_clean = train_detector(
        cfg.with_(p_clean=1.0),
        ds.frames,
        labels_from_set(ds),
        class_names=ds.class_names,
        views=views,
    )
    c = always_clean.net.state_dict()
    assert all(torch.equal(b[k], c[k]) for k in b)
    with pytest.raises(DataError, match="asks for 1 drifted views, got 0"):
        train_detector(cfg, ds.frames, labels_from_set(ds), class_names=ds.class_names)
    # Configs without views keep their cache keys; asking for views changes them.
    assert "drift_views" not in cfg.with_(drift_views=0).cache_fields()
    assert cfg.cache_fields()["drift_views"] == 1


def test_training_from_teacher_pseudo_labels(quick_pair: ReferenceDetectors) -> None:
    ds = _tiny_set()
    rows = OnnxDetector(quick_pair.teacher_onnx).detections(ds.frames)
    teacher = pseudo_labels(rows, ds.frame_size)
    assert all(len(t.boxes) == int((r[:, 4] > 0).sum()) for t, r in zip(teacher, rows, strict=True))
    # Teacher boxes are pixel boxes: fractions times the frame size.
    first = int(np.argmax([len(t.boxes) for t in teacher]))
    np.testing.assert_allclose(teacher[first].boxes[0], rows[first, 0, :4] * ds.frame_size)
    # A human label takes precedence where a frame has one.
    human: list[FrameBoxes | None] = [None] * len(ds)
    human[0] = labels_from_set(ds)[0]
    merged = merge_labels(human, teacher)
    assert merged[0] is human[0] and merged[1] is teacher[1]

    cfg = _tiny_config(min_score=0.4, ignore_score=0.2)
    result = train_detector(cfg, ds.frames, merged, class_names=ds.class_names)
    confident = sum(int((m.scores >= 0.4).sum()) for m in merged)
    assert result.metrics["train_objects"] == confident > 0
    assert np.isfinite(result.metrics["final_loss"])


def test_warm_start(quick_pair: ReferenceDetectors) -> None:
    ds = _tiny_set()
    student = load_detector(quick_pair.student_pt).net
    cfg = _tiny_config(lr=1e-9)
    result = train_detector(
        cfg, ds.frames, labels_from_set(ds), class_names=ds.class_names, init=student
    )
    start, end = student.state_dict(), result.net.state_dict()
    convs = [k for k in start if k.endswith("weight") and start[k].ndim == 4]
    assert all(torch.allclose(start[k], end[k], atol=1e-6) for k in convs)
    teacher = load_detector(quick_pair.teacher_pt).net
    with pytest.raises(ModelError, match="cannot warm-start"):
        train_detector(
            cfg, ds.frames, labels_from_set(ds), class_names=ds.class_names, init=teacher
        )


def test_targets_from_scored_boxes() -> None:
    labels = [FrameBoxes.of(np.array([[16, 8, 48, 72]]), np.array([3]))]
    ignore = [np.array([[80.0, 80.0, 120.0, 120.0]])]
    t = build_targets(labels, ignore, (20, 20), num_classes=10)
    # Centre (32, 40) px is cell (4, 5) at stride 8, the peak exactly 1 there only.
    assert t.heat[0, 3, 5, 4] == 1.0 and int((t.heat == 1.0).sum()) == 1
    assert t.centres[0, 5, 4] == 1.0
    assert t.size[0, :, 5, 4].tolist() == [4.0, 8.0]
    assert t.offset[0, :, 5, 4].tolist() == [0.0, 0.0]
    assert t.weight[0, 10:15, 10:15].sum() == 0 and t.weight[0, 0, 0] == 1.0


def test_profile_counts_conv_macs() -> None:
    from distill.detectors import build_detector

    net = build_detector("student-det", 10)
    p160, p320 = detector_profile(net, 160), detector_profile(net, 320)
    assert p320["macs"] == 4 * p160["macs"]
    stem = p320["layers"][0]
    assert stem["macs"] == 80 * 80 * stem["output"][0] * 3 * 4 * 4
    assert p320["params"] == sum(p.numel() for p in net.parameters())


def _rows(*rows: tuple[float, ...], k: int = 4) -> np.ndarray:
    """One frame's [1, k, 6] detections, zero-padded."""
    out = np.zeros((1, k, 6), np.float32)
    out[0, : len(rows)] = rows
    return out


def test_detections_diff_leaves_out_only_rows_that_rounding_can_tip() -> None:
    box = (0.1, 0.1, 0.3, 0.3, 0.9, 2.0)
    assert detections_diff(_rows(box), _rows(box)) == 0.0
    moved = (0.2, 0.2, 0.6, 0.6, 0.9, 2.0)  # a different box, same score and class
    assert detections_diff(_rows(box), _rows(moved)) == pytest.approx(0.3)
    # The 3x3 peak went to the neighbouring cell (its centre 0.05 away, one cell here),
    # whose box differs: a tie on the score is rounding, not a different model.
    neighbour = (0.15, 0.15, 0.35, 0.35, 0.9004, 2.0)
    assert detections_diff(_rows(box), _rows(neighbour), cell=0.05) == 0.0
    assert detections_diff(_rows(box), _rows(neighbour)) == pytest.approx(0.05, abs=1e-6)
    far_box = (0.5, 0.5, 0.9, 0.9, 0.9004, 2.0)  # a tie, but nowhere near: still counted
    assert detections_diff(_rows(box), _rows(far_box), cell=0.05) == pytest.approx(0.6)
    # The top-K cut: a full output whose last row ties a row the other output kept.
    full = [(0.1 * i, 0.0, 0.1 * i + 0.05, 0.05, 0.5, 1.0) for i in range(4)]
    cut = [*full[:3], (0.7, 0.7, 0.8, 0.8, 0.5003, 3.0)]
    assert detections_diff(_rows(*full), _rows(*cut)) < 1e-3
    assert detections_diff(_rows(*full[:3], (0.7, 0.7, 0.8, 0.8, 0.7, 3.0)), _rows(*full)) == float(
        "inf"
    )
