from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distill.cache import ReferenceModels
from distill.drift import Drift
from distill.evaluate import (
    OnnxClassifier,
    TorchClassifier,
    align_labels,
    drift_table,
    evaluate,
    load_classifier,
)
from distill.frames import FrameSet
from shared.errors import DataError, ModelError


def test_accuracy_of_quick_models(quick_models: ReferenceModels, quick_test_set: FrameSet) -> None:
    for path in (quick_models.teacher_onnx, quick_models.student_onnx, quick_models.student_pt):
        result = evaluate(load_classifier(path), quick_test_set)
        assert result.accuracy > 0.5, (path, result.accuracy)
        assert result.frames == len(quick_test_set) and result.drift == "none"
        assert set(result.per_class) == set(quick_test_set.class_names)


def test_drift_lowers_accuracy(quick_models: ReferenceModels, small_test_set: FrameSet) -> None:
    clf = OnnxClassifier(quick_models.student_onnx)
    clean = evaluate(clf, small_test_set).accuracy
    drifted = evaluate(clf, small_test_set, drift=(Drift("noise", 1.0),))
    assert drifted.accuracy < clean and drifted.drift == "noise:1"


def test_drift_table_shape_and_markdown(
    quick_models: ReferenceModels, small_test_set: FrameSet
) -> None:
    sample = small_test_set.subset(slice(0, 40))
    table = drift_table(
        {
            "student": OnnxClassifier(quick_models.student_onnx),
            "teacher": OnnxClassifier(quick_models.teacher_onnx),
        },
        sample,
        drifts=("blur", "rotation"),
        severities=(0.5, 1.0),
    )
    assert table.frames == 40
    assert set(table.cells["student"]) == {"blur", "rotation"}
    assert set(table.cells["teacher"]["blur"]) == {0.5, 1.0}
    md = table.to_markdown().splitlines()
    assert md[0] == "| drift | severity | student | teacher |"
    assert len(md) == 2 + 1 + 4  # header, rule, clean, 2 drifts x 2 severities
    assert (
        table.to_dict()["accuracy"]["teacher"]["rotation"]["1"]
        == table.cells["teacher"]["rotation"][1.0]
    )


def test_labels_are_matched_by_name(small_test_set: FrameSet) -> None:
    reordered = tuple(reversed(small_test_set.class_names))
    mapped = align_labels(small_test_set, reordered)
    assert [reordered[i] for i in mapped[:10]] == [
        small_test_set.class_names[i] for i in small_test_set.labels[:10]
    ]
    other = FrameSet(
        frames=small_test_set.frames[:2],
        labels=np.array([0, 1]),
        class_names=("cat", "dog"),
    )
    with pytest.raises(DataError, match="classes the model does not know: cat, dog"):
        align_labels(other, small_test_set.class_names)


def test_torch_and_onnx_classifiers_agree(
    quick_models: ReferenceModels, small_test_set: FrameSet
) -> None:
    a = TorchClassifier.from_checkpoint(quick_models.teacher_pt).scores(small_test_set.frames)
    b = OnnxClassifier(quick_models.teacher_onnx).scores(small_test_set.frames)
    assert (a.argmax(1) == b.argmax(1)).all()


def test_wrong_frame_size_and_bad_files(quick_models: ReferenceModels, tmp_path: Path) -> None:
    clf = OnnxClassifier(quick_models.student_onnx)
    small = FrameSet(
        frames=np.zeros((2, 32, 32, 3), np.uint8),
        labels=np.array([0, 1]),
        class_names=clf.class_names,
    )
    with pytest.raises(DataError, match="32 px but model"):
        evaluate(clf, small)
    with pytest.raises(ModelError, match="unknown model file type"):
        (tmp_path / "m.h5").write_bytes(b"")
        load_classifier(tmp_path / "m.h5")
    with pytest.raises(ModelError, match="no model at"):
        load_classifier(tmp_path / "none.onnx")
