"""A round's pieces for a fleet of its own classes: warm start across class sets,
per-class minimums, where replay and reference frames come from, and soft targets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from distill.distillation import (
    check_per_class,
    checkpoint_beside,
    reference_sets,
    soft_targets,
    warm_start,
)
from distill.models import ModelMeta, build_model, save_checkpoint, transfer_weights
from distill.scenario import DIGIT_CLASSES, ScenarioConfig
from shared.errors import DataError

SHAPES = ("circle", "square", "triangle")


def _checkpoint(path: Path, classes: tuple[str, ...]) -> Path:
    torch.manual_seed(0)
    net = build_model("student-cnn", len(classes), width=0.25)
    meta = ModelMeta(
        arch="student-cnn", num_classes=len(classes), class_names=classes, frame_size=32, width=0.25
    )
    save_checkpoint(path, net, meta)
    return path


def test_a_checkpoint_of_another_class_set_keeps_its_features_and_gets_a_fresh_head(
    tmp_path: Path,
) -> None:
    digits = _checkpoint(tmp_path / "digits.pt", DIGIT_CLASSES)
    start = warm_start([("base_checkpoint digits.pt", digits)], SHAPES, seed=0)
    assert start.arch == "student-cnn" and start.width == 0.25
    assert start.state["head.2.weight"].shape[0] == 3
    assert "its 10 classes (0, 1, 2" in start.note and "re-initialised head.2.weight" in start.note
    base = torch.load(digits, weights_only=True)["state_dict"]
    torch.testing.assert_close(start.state["features.0.0.weight"], base["features.0.0.weight"])
    # The same class set: every weight as it was, no re-initialisation.
    same = warm_start(
        [("missing", tmp_path / "nope.pt"), ("mine", _checkpoint(tmp_path / "s.pt", SHAPES))],
        SHAPES,
        seed=0,
    )
    assert same.source == "mine" and "re-initialised" not in same.note
    fresh = warm_start([], SHAPES, seed=0)
    assert fresh.source == "fresh" and "training a fresh student-cnn" in fresh.note


def test_the_checkpoint_models_train_wrote_is_found_beside_its_model() -> None:
    assert checkpoint_beside(Path("/m/student.int8.onnx")) == Path("/m/student.pt")
    assert checkpoint_beside(Path("/m/mine.onnx")) == Path("/m/mine.pt")


def test_transfer_weights_names_what_it_left() -> None:
    ten, three = build_model("student-cnn", 10, 0.25), build_model("student-cnn", 3, 0.25)
    assert transfer_weights(three, ten.state_dict()) == ["head.2.weight", "head.2.bias"]


def test_too_few_frames_per_class_names_the_classes_and_counts() -> None:
    fleet = np.array([0] * 12 + [1] * 3 + [2] * 9)
    with pytest.raises(DataError) as caught:
        check_per_class(SHAPES, fleet, np.array([2, 2]), 10, "data_dir x")
    assert caught.value.message == (
        "too few labelled frames for class(es) square: each class needs at least 10"
        " (min_per_class); have circle 12, square 3, triangle 11 (verified samples and"
        " data_dir x)"
    )
    check_per_class(SHAPES, fleet, np.array([1] * 7 + [2]), 10, "data_dir x")  # enough now


def test_replay_and_reference_come_from_the_folder_or_nowhere_never_the_digits(
    tmp_path: Path,
) -> None:
    scenario = ScenarioConfig(frame_size=32)
    none = reference_sets("", scenario, SHAPES, 32)
    assert none.kind == "none" and none.replay is none.val is none.test is None
    rng = np.random.default_rng(0)
    for i in range(40):
        # The folder's classes in another order than the model's: matched by name.
        name = ("triangle", "circle", "square")[i % 3]
        path = tmp_path / "data" / name / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(path)
    folder = reference_sets(str(tmp_path / "data"), scenario, SHAPES, 32)
    assert folder.kind == "folder" and folder.replay is not None
    assert folder.replay.class_names == SHAPES
    assert sum(len(s) for s in (folder.replay, folder.val, folder.test) if s is not None) == 40
    (tmp_path / "data" / "hexagon").mkdir()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "data" / "hexagon" / "h.png")
    with pytest.raises(DataError, match="data has classes the model does not know: hexagon"):
        reference_sets(str(tmp_path / "data"), scenario, SHAPES, 32)
    # Only a fleet of the digits, at the scenario's frame size, replays rendered digits.
    assert reference_sets("", scenario, DIGIT_CLASSES, 32).kind == "scenario"
    assert reference_sets("", scenario, DIGIT_CLASSES, 64).kind == "none"


def test_soft_targets_are_the_teachers_unless_a_human_overrode_it() -> None:
    soft = soft_targets(
        [0, 2, 1], [0, 1, 1], [[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.5]], [False, True, False], 3
    )
    np.testing.assert_allclose(soft[0], [0.6, 0.3, 0.1], rtol=1e-6)
    # A human's label against the teacher's, or scores of another class set: one-hot-ish.
    np.testing.assert_allclose(soft[1], [0.05 / 3, 0.05 / 3, 0.95 + 0.05 / 3], rtol=1e-6)
    np.testing.assert_allclose(soft[2], [0.05 / 3, 0.95 + 0.05 / 3, 0.05 / 3], rtol=1e-6)
