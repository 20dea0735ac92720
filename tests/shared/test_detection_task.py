"""Detection, the second task: IoU matching, answers, routing signals, messages, mAP."""

from __future__ import annotations

import contextlib
import io
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from shared.ids import new_sample_id
from shared.messages import SampleHeader, Verdict
from shared.tasks import DETECTION, Answer, Task, task_for
from shared.tasks.detection import average_precision, iou_matrix, match

A = (0.1, 0.1, 0.3, 0.3, 0.9, 1)  # x1, y1, x2, y2, score, class


def _box(x1: float, y1: float, x2: float, y2: float, score: float = 0.9, cls: int = 1) -> Any:
    return (x1, y1, x2, y2, score, cls)


def test_detection_is_a_registered_task() -> None:
    assert isinstance(DETECTION, Task)
    assert task_for("detection") is DETECTION
    assert DETECTION.gate_metric == "map50"
    assert "empty_audit" in DETECTION.routing_rules


def test_iou_edge_cases() -> None:
    a = np.array([[0.0, 0.0, 2.0, 2.0]])
    cases = {
        "same": ([0.0, 0.0, 2.0, 2.0], 1.0),
        "half": ([1.0, 0.0, 3.0, 2.0], 2 / 6),
        "touching edge": ([2.0, 0.0, 4.0, 2.0], 0.0),
        "disjoint": ([5.0, 5.0, 6.0, 6.0], 0.0),
        "inside": ([0.5, 0.5, 1.5, 1.5], 0.25),
    }
    for name, (b, expected) in cases.items():
        assert iou_matrix(a, np.array([b]))[0, 0] == pytest.approx(expected), name
    degenerate = iou_matrix(np.array([[1.0, 1.0, 1.0, 1.0]]), np.array([[1.0, 1.0, 1.0, 1.0]]))
    assert degenerate[0, 0] == 0.0  # zero area: no overlap, and no division by zero
    assert iou_matrix(np.zeros((0, 4)), a).shape == (0, 1)
    assert iou_matrix(a, np.zeros((0, 4))).shape == (1, 0)


def test_match_names_each_kind_of_difference() -> None:
    assert match([A], [A]).differences == ()
    assert match([], []).differences == ()
    assert match([], [A]).missed == (0,)
    assert match([A], []).extra == (0,)
    other_class = _box(0.1, 0.1, 0.3, 0.3, cls=7)
    assert match([other_class], [A]).wrong_class == ((0, 0),)
    shifted = _box(0.2, 0.2, 0.4, 0.4)  # IoU 1/7 with A: a loose overlap, not a match
    loose = match([shifted], [A])
    assert loose.differences == ("localisation",) and loose.missed == () and loose.extra == ()
    far = _box(0.6, 0.6, 0.8, 0.8)
    assert match([far], [A]).differences == ("missed", "extra")


def test_match_is_one_to_one_best_overlap_first() -> None:
    near = _box(0.1, 0.1, 0.3, 0.31)
    nearer = _box(0.1, 0.1, 0.3, 0.3)
    result = match([near, nearer], [A])
    assert [(s, t) for s, t, _ in result.pairs] == [(1, 0)]
    # The other box covers A closely too, but A is taken: a duplicate is an extra box.
    assert result.extra == (0,) and result.localisation == ()
    with pytest.raises(ValueError):
        match([A], [A], match_iou=0.3, loose_iou=0.5)


def test_answers_keep_boxes_over_the_threshold_most_confident_first() -> None:
    rows = np.zeros((2, 4, 6), np.float32)
    rows[0, 0] = (0.1, 0.1, 0.2, 0.2, 0.4, 3)
    rows[0, 1] = (0.5, 0.5, 0.7, 0.7, 0.8, 5)
    rows[0, 2] = (0.3, 0.3, 0.4, 0.4, 0.1, 2)  # under the 0.3 threshold
    first, empty = DETECTION.answers(rows)
    assert [b[5] for b in first.boxes] == [5, 3]
    assert first.label == 5 and first.confidence == pytest.approx(0.6)
    assert empty == Answer(0, 1.0, (), ())
    with pytest.raises(ValueError, match=r"\[N, K, 6\]"):
        DETECTION.answers(np.zeros((2, 4, 5)))


def test_signals_count_low_and_near_threshold_boxes() -> None:
    rows = np.zeros((2, 5, 6), np.float32)
    rows[0, :4, 4] = (0.95, 0.45, 0.35, 0.25)  # 0.25 is near the 0.3 threshold, not kept
    rows[0, :4, 5] = (2, 4, 4, 4)
    signals = DETECTION.signals(rows)
    assert signals.box_count == [3, 0]
    assert signals.low_share[0] == pytest.approx(2 / 3)  # 0.45 and 0.35 below low_score 0.5
    assert signals.near_count == [2, 0]  # 0.35 and 0.25 within 0.1 of 0.3
    assert signals.predicted == [2, 0]
    assert signals.confidence[0] == pytest.approx((0.95 + 0.45 + 0.35) / 3)
    assert signals.confidence[1] == 1.0


def _header(**fields: Any) -> SampleHeader:
    return SampleHeader(
        sample_id=new_sample_id(),
        fleet="f",
        agent="a",
        captured_at=datetime.now(UTC),
        model_name="detector",
        model_version="1",
        route_reason="low_confidence",
        image_format="jpeg",
        image_width=320,
        image_height=320,
        image_bytes=1,
        **fields,
    )


def test_an_answer_survives_the_sample_header_and_the_verdict() -> None:
    rows = np.zeros((3, 6), np.float32)
    rows[0] = (0.1, 0.2, 0.3, 0.4, 0.7, 4)
    rows[1] = (0.5, 0.5, 0.9, 0.8, 0.9, 2)
    header = _header(**DETECTION.sample_fields(rows))
    edge = DETECTION.sample_answer(SampleHeader.model_validate_json(header.model_dump_json()))
    assert [b[5] for b in edge.boxes] == [2, 4] and edge.label == 2
    assert edge.boxes[0][:4] == pytest.approx((0.5, 0.5, 0.9, 0.8))

    teacher = Answer(2, 0.9, (0.9,), ((0.5, 0.5, 0.9, 0.8, 0.9, 2),))
    comparison = DETECTION.compare(edge, teacher)
    assert comparison.differences == ("extra",) and not comparison.agrees
    verdict = Verdict(
        sample_id=header.sample_id,
        fleet="f",
        agent="a",
        teacher_model="t",
        teacher_version="1",
        agrees_with_edge=comparison.agrees,
        verified_at=datetime.now(UTC),
        **DETECTION.verdict_fields(teacher),
    )
    back = DETECTION.verdict_answer(Verdict.model_validate_json(verdict.model_dump_json()))
    assert back == teacher

    empty = _header(**DETECTION.sample_fields(np.zeros((3, 6), np.float32)))
    assert empty.boxes == [] and empty.scores == [] and empty.confidence == 1.0


def test_messages_refuse_malformed_boxes() -> None:
    good = {"scores": [0.9], "predicted": 1, "confidence": 0.9}
    for box, why in [
        ([0.3, 0.1, 0.2, 0.4, 0.9, 1], "corners"),
        ([0.1, 0.1, 1.2, 0.4, 0.9, 1], "corners"),
        ([0.1, 0.1, 0.2, 0.4, 1.5, 1], "score"),
        ([0.1, 0.1, 0.2, 0.4, 0.9, 1.5], "class"),
        ([0.1, 0.1, 0.2, 0.4, 0.9], "at least 6"),
    ]:
        with pytest.raises(ValidationError, match=why):
            _header(boxes=[box], **good)
    with pytest.raises(ValidationError, match="2 scores for 1 boxes"):
        _header(boxes=[[0.1, 0.1, 0.2, 0.2, 0.9, 1]], **{**good, "scores": [0.9, 0.8]})
    with pytest.raises(ValidationError, match="not an index"):  # a classifier's, as before
        _header(scores=[], predicted=0, confidence=0.5)


def _coco_map50(predicted: list[list[Any]], truth: list[list[Any]], size: int = 320) -> float:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def xywh(b: Any) -> list[float]:
        return [b[0] * size, b[1] * size, (b[2] - b[0]) * size, (b[3] - b[1]) * size]

    classes = sorted({int(b[5]) for frame in truth for b in frame} | {0})
    gt = COCO()
    gt.dataset = {
        "images": [{"id": i, "width": size, "height": size} for i in range(len(truth))],
        "categories": [{"id": c} for c in classes],
        "annotations": [
            {
                "id": n + 1,
                "image_id": i,
                "category_id": int(b[5]),
                "bbox": xywh(b),
                "area": xywh(b)[2] * xywh(b)[3],
                "iscrowd": 0,
            }
            for n, (i, b) in enumerate((i, b) for i, frame in enumerate(truth) for b in frame)
        ],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
        dets = [
            {"image_id": i, "category_id": int(b[5]), "bbox": xywh(b), "score": float(b[4])}
            for i, frame in enumerate(predicted)
            for b in frame
        ]
        evaluation = COCOeval(gt, gt.loadRes(dets), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return float(evaluation.stats[1])


def test_map50_agrees_with_pycocotools() -> None:
    rng = np.random.default_rng(3)
    truth: list[list[Any]] = []
    predicted: list[list[Any]] = []
    for _ in range(40):
        frame_truth, frame_pred = [], []
        for _ in range(int(rng.integers(0, 5))):
            x, y = rng.uniform(0.0, 0.7, 2)
            w, h = rng.uniform(0.08, 0.3, 2)
            cls = int(rng.integers(0, 4))
            frame_truth.append((x, y, x + w, y + h, 1.0, cls))
            if rng.random() < 0.85:  # found, with some jitter, sometimes the wrong class
                j = rng.normal(0.0, 0.03, 4)
                box = np.clip([x + j[0], y + j[1], x + w + j[2], y + h + j[3]], 0.0, 1.0)
                box = np.concatenate([np.minimum(box[:2], box[2:]), np.maximum(box[:2], box[2:])])
                found = cls if rng.random() < 0.9 else int(rng.integers(0, 4))
                frame_pred.append((*box.tolist(), float(rng.uniform(0.3, 1.0)), found))
        for _ in range(int(rng.integers(0, 2))):  # false positives
            x, y = rng.uniform(0.0, 0.8, 2)
            frame_pred.append((x, y, x + 0.1, y + 0.1, float(rng.uniform(0.3, 0.7)), 1))
        truth.append(frame_truth)
        predicted.append(frame_pred)
    ours = average_precision(predicted, truth)
    assert 0.3 < ours < 1.0
    assert ours == pytest.approx(_coco_map50(predicted, truth), abs=1e-6)
    assert average_precision(truth, truth) == pytest.approx(1.0)
    assert average_precision([[]], [[]]) == 0.0


# --- golden cases ------------------------------------------------------------------------


def _golden_frame(*rows: tuple[float, ...], k: int = 4) -> np.ndarray:
    out = np.zeros((1, k, 6))
    for i, row in enumerate(rows):
        out[0, i] = row
    return out


def test_golden_rows_flatten_each_frame_and_round_trip() -> None:
    out = _golden_frame((0.1, 0.1, 0.3, 0.3, 0.9, 1), (0.5, 0.5, 0.7, 0.7, 0.4, 2))
    rows = DETECTION.golden_rows(out)
    assert len(rows) == 1 and len(rows[0]) == 24
    DETECTION.check_golden_width(24, labels=3)
    with pytest.raises(ValueError, match="not whole rows of 6"):
        DETECTION.check_golden_width(25, labels=3)
    assert DETECTION.golden_difference(rows, out, atol=1e-3) == 0.0


def test_golden_difference_forgives_a_near_tie_swapped_by_another_cpu() -> None:
    want = _golden_frame((0.1, 0.1, 0.3, 0.3, 0.5001, 1), (0.6, 0.6, 0.9, 0.9, 0.5, 2))
    got = _golden_frame((0.6, 0.6, 0.9, 0.9, 0.5003, 2), (0.1, 0.1, 0.3, 0.3, 0.5, 1))
    assert DETECTION.golden_difference(DETECTION.golden_rows(want), got, atol=1e-3) <= 1e-3


def test_golden_difference_holds_settled_rows_to_their_box_and_class() -> None:
    want = _golden_frame((0.1, 0.1, 0.3, 0.3, 0.9, 1), (0.6, 0.6, 0.9, 0.9, 0.5, 2))
    rows = DETECTION.golden_rows(want)
    other_class = want.copy()
    other_class[0, 0, 5] = 0
    assert DETECTION.golden_difference(rows, other_class, atol=1e-3) == float("inf")
    moved = want.copy()
    moved[0, 1, :4] += 0.05
    assert DETECTION.golden_difference(rows, moved, atol=1e-3) == pytest.approx(0.05)
    rescored = want.copy()
    rescored[0, 0, 4] = 0.8
    assert DETECTION.golden_difference(rows, rescored, atol=1e-3) == pytest.approx(0.1)


def test_golden_difference_names_a_shape_that_does_not_fit() -> None:
    rows = DETECTION.golden_rows(_golden_frame((0.1, 0.1, 0.3, 0.3, 0.9, 1)))
    with pytest.raises(ValueError, match="expected 1 frames of 4 rows"):
        DETECTION.golden_difference(rows, np.zeros((1, 5, 6)), atol=1e-3)


def test_answers_keep_the_boxes_over_the_threshold_most_confident_first_within_the_frame() -> None:
    rows = np.array(
        [
            [
                [0.1, 0.1, 0.3, 0.3, 0.6, 1],
                [0.2, 0.2, 0.4, 0.4, 0.1, 2],  # under the threshold: left out
                [np.nan, -0.5, 1.5, np.inf, 0.9, 3],  # corners as fractions: into [0, 1]
                [0.5, 0.5, 0.7, 0.7, 0.6, 4],  # the same score as the first: after it
                [0.5, 0.5, 0.7, 0.7, np.nan, 5],  # no score: left out
            ]
        ],
        np.float32,
    )
    (answer,) = DETECTION.answers(rows)
    assert [b[5] for b in answer.boxes] == [3, 1, 4]
    assert answer.boxes[0][:4] == (0.0, 0.0, 1.0, 1.0)
    assert all(isinstance(b[5], int) and isinstance(b[0], float) for b in answer.boxes)
    assert answer.label == 3
    assert answer.confidence == pytest.approx((0.9 + 0.6 + 0.6) / 3)
    assert DETECTION.sample_fields(rows[0])["predicted"] == 3
