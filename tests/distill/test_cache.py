from __future__ import annotations

from pathlib import Path

import pytest

from distill.cache import (
    ReferenceConfig,
    ReferenceModels,
    bootstrap_reference_models,
    cache_key,
    default_cache_dir,
    reference_model_path,
)
from shared.errors import ModelError


def _files(refs: ReferenceModels) -> list[Path]:
    return [
        refs.teacher_pt,
        refs.teacher_onnx,
        refs.student_pt,
        refs.student_onnx,
        refs.student_int8_onnx,
    ]


def test_bootstrap_produces_every_artifact(quick_models: ReferenceModels) -> None:
    for path in _files(quick_models):
        assert path.is_file() and path.stat().st_size > 0
    m = quick_models.metrics
    assert m["teacher"]["test_accuracy"] > 0.5 and m["student"]["test_accuracy"] > 0.5
    assert m["student"]["params"] < m["teacher"]["params"]
    assert m["student"]["distilled_from"] == quick_models.teacher_key
    assert quick_models.class_names == tuple(str(d) for d in range(10))


def test_cache_hit_does_not_retrain(quick_models: ReferenceModels, model_cache: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in _files(quick_models)}
    again = bootstrap_reference_models(model_cache, quick=True)
    assert again.built == ()  # nothing trained or exported again
    assert {p: p.stat().st_mtime_ns for p in _files(again)} == before
    assert again.metrics["student"] == quick_models.metrics["student"]


def test_no_scratch_folders_left(quick_models: ReferenceModels, model_cache: Path) -> None:
    # The cache is shared across runs (and with other models' entries): look at the
    # entries of this configuration only.
    quick = ReferenceConfig.reference(quick=True)
    keys = {"teacher": quick.teacher_key(), "student": quick.student_key()}
    names = [p.name for p in model_cache.iterdir()]
    assert not [n for n in names if n.startswith(".tmp-") and any(k in n for k in keys.values())]
    for role, key in keys.items():
        assert f"{role}-{key}" in names


def test_keys_follow_configuration() -> None:
    quick, full = ReferenceConfig.reference(quick=True), ReferenceConfig.reference()
    assert quick.teacher_key() != full.teacher_key()
    assert quick.student_key() != full.student_key()
    assert quick.teacher_key() == ReferenceConfig.reference(quick=True).teacher_key()
    assert cache_key({"a": 1, "b": (1, 2)}) == cache_key({"b": [1, 2], "a": 1})


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EDGELOOP_DATA_DIR", str(tmp_path / "data"))
    assert default_cache_dir() == tmp_path / "data" / "models" / "cache"
    monkeypatch.delenv("EDGELOOP_DATA_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "edgeloop" / "models"


def test_reference_model_path(
    quick_models: ReferenceModels, model_cache: Path, tmp_path: Path
) -> None:
    assert (
        reference_model_path("student-int8", model_cache, quick=True)
        == quick_models.student_int8_onnx
    )
    assert reference_model_path("teacher.pt", model_cache, quick=True) == quick_models.teacher_pt
    with pytest.raises(ModelError, match="run `edgeloop models bootstrap --quick` first"):
        reference_model_path("student", tmp_path, quick=True)
    with pytest.raises(ModelError, match="unknown reference model"):
        reference_model_path("oracle", model_cache, quick=True)


@pytest.mark.slow
def test_incomplete_entry_is_rebuilt(quick_models: ReferenceModels, tmp_path: Path) -> None:
    """A damaged entry (a file deleted by hand) is detected and rebuilt, not served."""
    scratch = tmp_path / "damaged-cache"
    scratch.mkdir()
    teacher_dir = quick_models.teacher_onnx.parent
    target = scratch / teacher_dir.name
    target.mkdir()
    for p in teacher_dir.iterdir():
        (target / p.name).write_bytes(p.read_bytes())
    student_dir = quick_models.student_onnx.parent
    (scratch / student_dir.name).mkdir()
    for p in student_dir.iterdir():
        if p.name != "student.int8.onnx":
            (scratch / student_dir.name / p.name).write_bytes(p.read_bytes())
    # Teacher complete (reused), student incomplete: only the student is rebuilt.
    refs = bootstrap_reference_models(scratch, quick=True)
    assert refs.built == ("student",)
    assert refs.student_int8_onnx.is_file()
