"""Detection, the second task: boxes with a class and a score per object in a frame.

A detector's ONNX model answers ``detections``: float32 ``[batch, K, 6]``, each row
``x1, y1, x2, y2, score, class`` with the corners as fractions of the frame's width
and height (so an answer does not depend on the model's input size), rows sorted by
score, padding rows scored 0. Peak extraction (or NMS) happens inside the graph; this
module thresholds, summarises, compares and scores those rows.

In messages an answer is its ``boxes`` (the same six numbers per kept box), and the
fields every task fills: ``scores`` (each box's score), ``predicted`` (the class of the
most confident box; 0 on an empty frame) and ``confidence`` (the mean box score; 1.0 on
an empty frame: nothing in it is in doubt, which is why empty frames are audited by a
rule of their own).

Student and teacher are compared by IoU matching (:func:`match`): a teacher box no
student box covers is ``missed``, a student box no teacher box covers is ``extra``, a
matched pair of other classes is ``wrong_class``, and a teacher box overlapped only
loosely (IoU between ``loose_iou`` and ``match_iou``) is a ``localisation`` error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from shared.tasks.contract import Answer, Box, Comparison, Signals, unit

__all__ = [
    "DETECTION",
    "DetectionSignals",
    "DetectionTask",
    "Matching",
    "average_precision",
    "iou_matrix",
    "match",
]

ROW = 6  # x1, y1, x2, y2, score, class


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in ``a`` [n, 4+] against every box in ``b`` [m, 4+] (xyxy)."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, np.shape(a)[-1] if np.size(a) else 4)
    b = np.asarray(b, dtype=np.float64).reshape(-1, np.shape(b)[-1] if np.size(b) else 4)
    if not len(a) or not len(b):
        return np.zeros((len(a), len(b)))
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = np.clip(a[:, 2] - a[:, 0], 0, None) * np.clip(a[:, 3] - a[:, 1], 0, None)
    area_b = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, inter / union, 0.0)


@dataclass(frozen=True)
class Matching:
    """Student boxes against teacher boxes, by index into each answer's boxes."""

    pairs: tuple[tuple[int, int, float], ...]  # (student, teacher, IoU), IoU >= match_iou
    wrong_class: tuple[tuple[int, int], ...]  # matched pairs whose classes differ
    localisation: tuple[tuple[int, int, float], ...]  # loose overlaps, no match
    missed: tuple[int, ...]  # teacher boxes nothing covers
    extra: tuple[int, ...]  # student boxes that cover nothing

    @property
    def differences(self) -> tuple[str, ...]:
        """The kinds of difference present, in a fixed order."""
        kinds = {
            "missed": self.missed,
            "extra": self.extra,
            "wrong_class": self.wrong_class,
            "localisation": self.localisation,
        }
        return tuple(kind for kind, found in kinds.items() if found)


def _greedy(iou: np.ndarray, threshold: float) -> list[tuple[int, int, float]]:
    """Pairs by falling IoU, each box used once, IoU at least ``threshold``."""
    pairs: list[tuple[int, int, float]] = []
    if not iou.size:
        return pairs
    order = np.argsort(-iou, axis=None, kind="stable")
    used_s: set[int] = set()
    used_t: set[int] = set()
    for flat in order:
        s, t = divmod(int(flat), iou.shape[1])
        value = float(iou[s, t])
        if value < threshold or value <= 0.0:
            break
        if s in used_s or t in used_t:
            continue
        used_s.add(s)
        used_t.add(t)
        pairs.append((s, t, value))
    return pairs


def match(
    student: Sequence[Box],
    teacher: Sequence[Box],
    *,
    match_iou: float = 0.5,
    loose_iou: float = 0.1,
) -> Matching:
    """Match student to teacher boxes, class-agnostic, by IoU (greedy, highest first).

    Pairs at ``match_iou`` or above are matches (of another class: ``wrong_class``);
    among the boxes left, pairs at ``loose_iou`` or above are ``localisation`` errors;
    what is left of the teacher's is ``missed``, of the student's ``extra``.
    """
    if not 0.0 < loose_iou <= match_iou <= 1.0:
        raise ValueError("need 0 < loose_iou <= match_iou <= 1")
    s_boxes = np.asarray([b[:4] for b in student], dtype=np.float64).reshape(-1, 4)
    t_boxes = np.asarray([b[:4] for b in teacher], dtype=np.float64).reshape(-1, 4)
    iou = iou_matrix(s_boxes, t_boxes)
    pairs = _greedy(iou, match_iou)
    s_left = sorted(set(range(len(student))) - {s for s, _, _ in pairs})
    t_left = sorted(set(range(len(teacher))) - {t for _, t, _ in pairs})
    loose = [
        (s_left[s], t_left[t], value)
        for s, t, value in _greedy(iou[np.ix_(s_left, t_left)], loose_iou)
    ]
    wrong = tuple((s, t) for s, t, _ in pairs if int(student[s][5]) != int(teacher[t][5]))
    return Matching(
        pairs=tuple(pairs),
        wrong_class=wrong,
        localisation=tuple(loose),
        missed=tuple(t for t in t_left if t not in {t for _, t, _ in loose}),
        extra=tuple(s for s in s_left if s not in {s for s, _, _ in loose}),
    )


def average_precision(
    predicted: Sequence[Sequence[Box]],
    truth: Sequence[Sequence[Box]],
    *,
    iou: float = 0.5,
) -> float:
    """mAP at one IoU threshold over frames: per class, COCO's 101-point interpolated
    precision, averaged over the classes that have ground truth (0.0 when none do).

    ``truth`` boxes carry a class in their sixth number (their score is ignored).
    The distillation gate scores with pycocotools; this is the same computation
    without it, for the edge and the contracts (the tests hold the two together).
    """
    if len(predicted) != len(truth):
        raise ValueError(f"{len(predicted)} answers for {len(truth)} frames")
    classes = sorted({int(b[5]) for frame in truth for b in frame})
    if not classes:
        return 0.0
    recall_points = np.linspace(0.0, 1.0, 101)
    aps = []
    for c in classes:
        gts = [np.asarray([b[:4] for b in f if int(b[5]) == c]).reshape(-1, 4) for f in truth]
        n_gt = sum(len(g) for g in gts)
        dets = [
            (float(b[4]), i, np.asarray(b[:4], dtype=np.float64))
            for i, frame in enumerate(predicted)
            for b in frame
            if int(b[5]) == c
        ]
        dets.sort(key=lambda d: -d[0])
        taken = [np.zeros(len(g), dtype=bool) for g in gts]
        tp = np.zeros(len(dets))
        for k, (_, i, box) in enumerate(dets):
            if not len(gts[i]):
                continue
            overlaps = iou_matrix(box[None, :], gts[i])[0]
            overlaps[taken[i]] = -1.0
            best = int(overlaps.argmax())
            if overlaps[best] >= iou:
                taken[i][best] = True
                tp[k] = 1.0
        if not len(dets):
            aps.append(0.0)
            continue
        ctp = np.cumsum(tp)
        recall = ctp / n_gt
        precision = ctp / np.arange(1, len(dets) + 1)
        # The precision envelope: at each recall, the best precision at that recall or more.
        precision = np.maximum.accumulate(precision[::-1])[::-1]
        at = np.searchsorted(recall, recall_points, side="left")
        sampled = np.where(at < len(precision), precision[np.minimum(at, len(precision) - 1)], 0.0)
        aps.append(float(sampled.mean()))
    return float(np.mean(aps))


@dataclass(frozen=True)
class DetectionSignals(Signals):
    """Classification's signals (from the summary) and what the detection rules read."""

    box_count: list[int] = field(default_factory=list)
    low_share: list[float] = field(default_factory=list)  # share of boxes below low_score
    near_count: list[int] = field(default_factory=list)  # boxes within near of the threshold


class DetectionTask:
    """Boxes per frame from a detector's ``detections`` rows."""

    name: ClassVar[str] = "detection"
    output_name: ClassVar[str] = "detections"
    gate_metric: ClassVar[str] = "map50"
    review_label: ClassVar[str] = "boxes"
    routing_rules: ClassVar[tuple[str, ...]] = (
        "mean_score",
        "low_score_share",
        "near_threshold",
        "box_count",
        "empty_audit",
    )
    export_formats: ClassVar[tuple[str, ...]] = ("coco", "yolo", "labelstudio", "json", "zip")

    def __init__(
        self, *, score_threshold: float = 0.3, low_score: float = 0.5, near: float = 0.1
    ) -> None:
        if not 0.0 <= score_threshold < 1.0:
            raise ValueError("score_threshold must be in [0, 1)")
        self.score_threshold = score_threshold  # boxes below it are not part of an answer
        self.low_score = low_score  # a kept box below it is a low-confidence box
        self.near = near  # a candidate within this of the threshold is near it

    # --- model output ------------------------------------------------------------------

    @staticmethod
    def _rows(outputs: np.ndarray) -> np.ndarray:
        d = np.asarray(outputs, dtype=np.float64)
        if d.ndim == 2:
            d = d[None]
        if d.ndim != 3 or d.shape[2] != ROW:
            raise ValueError(f"expected [N, K, 6] detection rows, got shape {d.shape}")
        return d

    def _boxes(self, rows: np.ndarray) -> tuple[Box, ...]:
        """The rows at or above the score threshold, most confident first (ties in row
        order), each value as ``unit`` makes it and the class as an int. A frame holds a
        few dozen rows: one conversion to Python floats, then plain Python, costs less
        than numpy's per-call overhead on arrays this small."""
        kept = rows[rows[:, 4] >= max(self.score_threshold, 1e-9)].tolist()
        kept.sort(key=_score, reverse=True)  # stable: equal scores keep their order
        return tuple(
            (unit(x1), unit(y1), unit(x2), unit(y2), unit(score), int(label))
            for x1, y1, x2, y2, score, label in kept
        )

    def answers(self, outputs: np.ndarray) -> list[Answer]:
        """Each frame's boxes at or above the score threshold, most confident first."""
        return [self._answer(self._boxes(rows)) for rows in self._rows(outputs)]

    @staticmethod
    def _answer(boxes: tuple[Box, ...]) -> Answer:
        if not boxes:
            return Answer(0, 1.0, (), boxes)
        scores = tuple(b[4] for b in boxes)
        best = max(range(len(scores)), key=scores.__getitem__)  # the first of the highest
        return Answer(int(boxes[best][5]), sum(scores) / len(scores), scores, boxes)

    def signals(self, outputs: np.ndarray) -> DetectionSignals:
        """Per frame: the summary (class of the top box, mean score), the number of
        boxes, the share of them below ``low_score`` and the candidates near the threshold."""
        d = self._rows(outputs)
        score = d[:, :, 4]
        kept = score >= max(self.score_threshold, 1e-9)
        count = kept.sum(axis=1)
        mean = np.where(count > 0, (score * kept).sum(axis=1) / np.maximum(count, 1), 1.0)
        low = (kept & (score < self.low_score)).sum(axis=1)
        near = (np.abs(score - self.score_threshold) <= self.near) & (score > 0)
        top = np.argmax(np.where(kept, score, -1.0), axis=1)
        predicted = np.where(count > 0, d[np.arange(len(d)), top, 5], 0).astype(int)
        return DetectionSignals(
            predicted=predicted.tolist(),
            confidence=mean.tolist(),
            margin=[0.0] * len(d),
            entropy=[0.0] * len(d),
            box_count=count.astype(int).tolist(),
            low_share=np.where(count > 0, low / np.maximum(count, 1), 0.0).tolist(),
            near_count=near.sum(axis=1).astype(int).tolist(),
        )

    # --- messages ----------------------------------------------------------------------

    def sample_fields(self, output: np.ndarray) -> dict[str, Any]:
        """The edge's answer for one frame (its ``[K, 6]`` rows) as sample-header fields."""
        answer = self._answer(self._boxes(self._rows(output)[0]))
        return {**self._fields(answer), "predicted": answer.label}

    def sample_answer(self, header: Any) -> Answer:
        """The edge's answer from a sample header's ``boxes``."""
        return self._answer(_checked_boxes(header.boxes))

    def verdict_fields(self, answer: Answer) -> dict[str, Any]:
        """The teacher's answer as verdict fields."""
        return {**self._fields(answer), "label": answer.label}

    def verdict_answer(self, verdict: Any) -> Answer:
        """The teacher's answer from a verdict's ``boxes``."""
        return self._answer(_checked_boxes(verdict.boxes))

    @staticmethod
    def _fields(answer: Answer) -> dict[str, Any]:
        return {
            "scores": [b[4] for b in answer.boxes],
            "confidence": unit(answer.confidence),
            "boxes": [list(b) for b in answer.boxes],
        }

    # --- judging -----------------------------------------------------------------------

    def compare(self, student: Answer, teacher: Answer) -> Comparison:
        """They agree when every box matches one of the same class (:func:`match`)."""
        differences = match(student.boxes, teacher.boxes).differences
        return Comparison(not differences, differences)

    def score(self, predicted: Sequence[Answer], truth: Sequence[Any]) -> float:
        """mAP@0.5 of the answers against ground-truth boxes per frame."""
        return average_precision([a.boxes for a in predicted], truth)

    # --- golden cases (a manifest's check that an agent's runtime computes the same) ----

    def golden_rows(self, outputs: np.ndarray) -> list[list[float]]:
        """One flat row of ``K * 6`` numbers per golden frame."""
        d = self._rows(outputs)
        return [[float(x) for x in rows.reshape(-1)] for rows in d]

    def check_golden_width(self, width: int, labels: int) -> None:
        """ValueError unless a golden row is whole detection rows."""
        if width < ROW or width % ROW:
            raise ValueError(f"{width} numbers per input are not whole rows of {ROW}")

    def golden_difference(
        self, expected: Sequence[Sequence[float]], outputs: np.ndarray, atol: float
    ) -> float:
        """How far a runtime's detections are from the expected ones, order-free where
        the order is not determined.

        The score columns are compared sorted (TopK may break a near-tie either way
        on another CPU); a row whose score is more than ``2 * atol`` from both its
        neighbours' holds its rank, and its box and class must agree too (another
        class is an infinite difference). Padding rows (score 0) carry no box.
        """
        got = self._rows(outputs)
        want = np.asarray(expected, dtype=np.float64)
        if want.shape != (got.shape[0], got.shape[1] * ROW):
            raise ValueError(
                f"gave shape {list(got.shape)}, expected {len(want)} frames of"
                f" {want.shape[1] // ROW if want.ndim == 2 else '?'} rows of {ROW}"
            )
        want = want.reshape(got.shape)
        worst = 0.0
        for w, g in zip(want, got, strict=True):
            worst = max(worst, float(np.max(np.abs(np.sort(w[:, 4]) - np.sort(g[:, 4])))))
            padded = np.concatenate(([np.inf], w[:, 4], [-np.inf]))
            gap = np.minimum(np.abs(padded[:-2] - padded[1:-1]), np.abs(padded[1:-1] - padded[2:]))
            settled = (gap > 2 * atol) & (w[:, 4] > 0)
            if np.any(w[settled, 5] != g[settled, 5]):
                return float("inf")
            if settled.any():
                worst = max(worst, float(np.max(np.abs(w[settled, :4] - g[settled, :4]))))
        return worst


def _checked_boxes(rows: Sequence[Sequence[float]] | None) -> tuple[Box, ...]:
    """Boxes from a message, sorted by score; None (a message without boxes) is none."""
    boxes = []
    for row in rows or ():
        if len(row) != ROW:
            raise ValueError(
                f"a box is {ROW} numbers (x1, y1, x2, y2, score, class), not {len(row)}"
            )
        x1, y1, x2, y2, score, cls = (float(v) for v in row)
        if not (0.0 <= x1 <= x2 <= 1.0 and 0.0 <= y1 <= y2 <= 1.0 and 0.0 <= score <= 1.0):
            raise ValueError(f"box {list(row)} is not x1 <= x2, y1 <= y2 within [0, 1]")
        if cls != int(cls) or cls < 0:
            raise ValueError(f"box class {cls} is not a class index")
        boxes.append((x1, y1, x2, y2, score, int(cls)))
    boxes.sort(key=lambda b: -b[4])
    return tuple(boxes)


DETECTION = DetectionTask()


def _score(row: list[float]) -> float:
    return row[4]
