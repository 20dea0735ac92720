"""The reference detector pair, trained once and cached by what it was made from.

A cache entry is a folder ``det-<role>-<key>``: the key hashes the source scans'
identity, the detection scenario's render parameters, the training configuration,
what else the model depends on (the teacher, for the student) and
``DETECTOR_CODE_VERSION``. Entries are built in a scratch folder beside the cache and
renamed into place in one step, so a reader sees a complete entry or none; a lock
file keeps two processes from building the same entry at once.

``bootstrap_reference_detectors(cache_dir, quick=...)`` builds what is missing:

- the teacher, trained on the ground truth of the training split, shown each frame
  clean or in one of ``drift_views`` random mixes of the named drifts;
- the student, trained on the same frames' ground truth (the human labels) plus
  ``pseudo_frames`` further frames from the training pool that only the teacher
  labelled (its boxes at or above the student's ``min_score``), exported to ONNX and
  quantized to INT8 (calibrated on stream frames).

Both are scored on the test split with pycocotools. ``quick=True`` is a small
configuration for tests (160 px frames with digits scaled up to match, a narrow
teacher, a few epochs), small enough to build inside a test session and still far
above chance.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from distill._io import atomic_write_json, build_entry, cache_lock
from distill.cache import cache_key, cached_reference_file, default_cache_dir, entry_complete
from distill.detector_eval import OnnxDetector, evaluate_detector
from distill.detector_export import export_detector, quantize_detector
from distill.detector_train import (
    DetTrainConfig,
    labels_from_set,
    merge_labels,
    pseudo_labels,
    train_detector,
)
from distill.detectors import DetectorMeta, detector_profile, save_detector
from distill.quantize_static import DEFAULT_SETTINGS, QuantSettings
from distill.scenario import DIGIT_CLASSES, Split, load_digit_sources
from distill.scene_drift import random_scene_drifts
from distill.scenes import DetectionSet, SceneConfig, render_scenes
from shared.errors import ModelError

__all__ = [
    "DETECTOR_CODE_VERSION",
    "DetectorReferenceConfig",
    "ReferenceDetectors",
    "bootstrap_reference_detectors",
    "reference_detector_path",
    "reference_scenario",
]

# Bump whenever rendering, architectures, training, export or quantization change
# what a given configuration produces; old entries are then simply not found.
DETECTOR_CODE_VERSION = "2026.12-1"
_NAME = "edgeloop-digits-det"


@dataclass(frozen=True)
class DetectorReferenceConfig:
    """Everything that decides the reference detector pair."""

    scenario: SceneConfig
    teacher: DetTrainConfig
    student: DetTrainConfig
    pseudo_frames: int = 500  # training-pool frames beyond the labelled ones, teacher-labelled
    quant_settings: QuantSettings = DEFAULT_SETTINGS
    calibration_frames: int = 256  # stream frames the INT8 student is calibrated on

    def __post_init__(self) -> None:
        size = self.scenario.frame_size
        if self.teacher.frame_size != size or self.student.frame_size != size:
            raise ModelError("teacher, student and scenario must use the same frame size")
        if self.pseudo_frames < 0 or self.calibration_frames < 1:
            raise ModelError("pseudo_frames must be >= 0 and calibration_frames >= 1")

    @classmethod
    def reference(cls, *, quick: bool = False) -> DetectorReferenceConfig:
        if not quick:
            return cls(
                scenario=SceneConfig(),
                teacher=DetTrainConfig(
                    role="teacher", epochs=30, crop=160, drift_views=2, p_clean=0.5
                ),
                student=DetTrainConfig(role="student", epochs=40, crop=160),
                pseudo_frames=500,
            )
        # Quick: 160 px frames with the digits scaled up to the full scenario's pixel
        # sizes, whole frames (no crops), a half-width teacher and a few epochs.
        scenario = SceneConfig(
            frame_size=160,
            train_frames=400,
            eval_frames=100,
            stream_frames=64,
            scale_range=(0.15, 0.35),
        )
        return cls(
            scenario=scenario,
            teacher=DetTrainConfig(role="teacher", width=0.5, epochs=12, frame_size=160, crop=0),
            student=DetTrainConfig(role="student", epochs=12, frame_size=160, crop=0),
            pseudo_frames=100,
            calibration_frames=64,
        )

    def _base(self) -> dict[str, Any]:
        return {
            "code": DETECTOR_CODE_VERSION,
            "data": load_digit_sources().identity,
            "scenario": self.scenario.as_dict(),
        }

    def teacher_key(self) -> str:
        return cache_key(
            {**self._base(), "kind": "det-teacher", "train": self.teacher.cache_fields()}
        )

    def student_key(self) -> str:
        return cache_key(
            {
                **self._base(),
                "kind": "det-student",
                "train": self.student.cache_fields(),
                "teacher": self.teacher_key(),
                "pseudo_frames": self.pseudo_frames,
                "quant": asdict(self.quant_settings),
                "calibration_frames": self.calibration_frames,
            }
        )


@dataclass(frozen=True)
class ReferenceDetectors:
    teacher_pt: Path
    teacher_onnx: Path
    student_pt: Path
    student_onnx: Path
    student_int8_onnx: Path
    metrics_json: Path  # the student entry's metrics, the teacher's summarised in it
    class_names: tuple[str, ...]
    frame_size: int
    metrics: dict[str, Any]
    teacher_key: str
    student_key: str
    quick: bool
    built: tuple[str, ...] = field(default=())  # entries built by this call

    def to_dict(self) -> dict[str, Any]:
        paths = ("teacher_pt", "teacher_onnx", "student_pt", "student_onnx", "student_int8_onnx")
        return {
            **{p: str(getattr(self, p)) for p in (*paths, "metrics_json")},
            "class_names": list(self.class_names),
            "frame_size": self.frame_size,
            "teacher_key": self.teacher_key,
            "student_key": self.student_key,
            "quick": self.quick,
            "built": list(self.built),
            "metrics": self.metrics,
        }


def _entry_dir(cache_dir: Path, role: str, key: str) -> Path:
    return cache_dir / f"det-{role}-{key}"


def _session(path: Path, cfg: DetectorReferenceConfig) -> OnnxDetector:
    """An ONNX Runtime session on as many threads as training used (the same machine)."""
    return OnnxDetector(path, threads=cfg.student.threads)


def _scenario_sets(cfg: DetectorReferenceConfig, *splits: Split) -> list[DetectionSet]:
    return [render_scenes(split, cfg.scenario) for split in splits]


def _build_teacher(
    cfg: DetectorReferenceConfig, key: str, out: Path, *, progress: bool, console: Console | None
) -> dict[str, Any]:
    started = time.perf_counter()
    train, val, test = _scenario_sets(cfg, "train", "validation", "test")
    name, version, size = f"{_NAME}-teacher", f"ref-{key[:12]}", cfg.scenario.frame_size
    views = [random_scene_drifts(train, seed=k) for k in range(cfg.teacher.drift_views)]
    result = train_detector(
        cfg.teacher,
        train.frames,
        labels_from_set(train),
        class_names=train.class_names,
        val_set=val,
        views=[(v.frames, labels_from_set(v)) for v in views],
        progress=progress,
        console=console,
    )
    profile = detector_profile(result.net, size)
    export = export_detector(
        result.net,
        out / "teacher.onnx",
        class_names=train.class_names,
        frame_size=size,
        name=name,
        version=version,
        check_frames=test.frames,
    )
    test_metrics = evaluate_detector(_session(out / "teacher.onnx", cfg), test)
    meta = DetectorMeta(
        arch=cfg.teacher.arch,
        class_names=train.class_names,
        frame_size=size,
        width=cfg.teacher.width,
        name=name,
        version=version,
        train_config=cfg.teacher.cache_fields(),
    )
    save_detector(out / "teacher.pt", result.net, meta)
    metrics = {
        "name": name,
        "version": version,
        "key": key,
        "train": result.metrics,
        "history": result.history,
        "params": profile["params"],
        "macs_per_frame": profile["macs"],
        "flops_per_frame": profile["flops"],
        "export": {**export.to_dict(), "path": "teacher.onnx"},
        "test": test_metrics.to_dict(),
        "config": cfg.teacher.cache_fields(),
        "build_wall_s": round(time.perf_counter() - started, 2),
    }
    atomic_write_json(out / "metrics.json", metrics)
    return metrics


def _build_student(
    cfg: DetectorReferenceConfig,
    key: str,
    teacher_dir: Path,
    out: Path,
    *,
    progress: bool,
    console: Console | None,
) -> dict[str, Any]:
    started = time.perf_counter()
    sc = cfg.scenario
    val, test = _scenario_sets(cfg, "validation", "test")
    labelled = sc.train_frames
    # The training pool rendered further: a frame does not change with the frame
    # count, so the first frames are the teacher's, the rest are new to both.
    pool = render_scenes("train", replace(sc, train_frames=labelled + cfg.pseudo_frames))
    human = [*labels_from_set(pool.subset(slice(0, labelled))), *[None] * cfg.pseudo_frames]
    teacher_labels: list[Any] = [None] * labelled
    if cfg.pseudo_frames:
        teacher_model = _session(teacher_dir / "teacher.onnx", cfg)
        teacher_rows = teacher_model.detections(pool.frames[labelled:])
        teacher_labels += pseudo_labels(teacher_rows, sc.frame_size)
    labels = merge_labels(human, teacher_labels)
    name, version = f"{_NAME}-student", f"ref-{key[:12]}"
    result = train_detector(
        cfg.student,
        pool.frames,
        labels,
        class_names=pool.class_names,
        val_set=val,
        progress=progress,
        console=console,
    )
    profile = detector_profile(result.net, sc.frame_size)
    export = export_detector(
        result.net,
        out / "student.onnx",
        class_names=pool.class_names,
        frame_size=sc.frame_size,
        name=name,
        version=version,
        check_frames=test.frames,
    )
    stream = render_scenes("stream", sc)
    quant = quantize_detector(
        out / "student.onnx",
        out / "student.int8.onnx",
        stream.frames[: cfg.calibration_frames],
        cfg.quant_settings,
    )
    fp32 = evaluate_detector(_session(out / "student.onnx", cfg), test)
    int8 = evaluate_detector(_session(out / "student.int8.onnx", cfg), test)
    meta = DetectorMeta(
        arch=cfg.student.arch,
        class_names=pool.class_names,
        frame_size=sc.frame_size,
        width=cfg.student.width,
        name=name,
        version=version,
        train_config=cfg.student.cache_fields(),
    )
    save_detector(out / "student.pt", result.net, meta)
    teacher = json.loads((teacher_dir / "metrics.json").read_text())
    metrics = {
        "name": name,
        "version": version,
        "key": key,
        "train": {**result.metrics, "human_frames": labelled, "pseudo_frames": cfg.pseudo_frames},
        "history": result.history,
        "params": profile["params"],
        "macs_per_frame": profile["macs"],
        "flops_per_frame": profile["flops"],
        "layers": profile["layers"],
        "export": {**export.to_dict(), "path": "student.onnx"},
        "quantization": {**quant.to_dict(), "path": "student.int8.onnx"},
        "test": fp32.to_dict(),
        "int8_test": int8.to_dict(),
        "int8_map50_drop": round(fp32.map50 - int8.map50, 5),
        "teacher": {
            "key": teacher["key"],
            "params": teacher["params"],
            "macs_per_frame": teacher["macs_per_frame"],
            "test": teacher["test"],
            "train_wall_s": teacher["train"]["train_wall_s"],
        },
        "config": cfg.student.cache_fields(),
        "scenario": sc.as_dict(),
        "code_version": DETECTOR_CODE_VERSION,
        "build_wall_s": round(time.perf_counter() - started, 2),
    }
    atomic_write_json(out / "metrics.json", metrics)
    return metrics


def reference_scenario(frame_size: int) -> SceneConfig:
    """The reference scenario a detector of ``frame_size`` was made on: the quick
    pair's at its size, else the full one's at ``frame_size``."""
    quick = DetectorReferenceConfig.reference(quick=True).scenario
    if frame_size == quick.frame_size:
        return quick
    return replace(SceneConfig(), frame_size=frame_size)


_DETECTOR_FILES = {
    "teacher": ("teacher", "teacher.onnx"),
    "student": ("student", "student.onnx"),
    "student-int8": ("student", "student.int8.onnx"),
}


def reference_detector_path(
    alias: str, cache_dir: Path | None = None, *, quick: bool = False
) -> Path:
    """The cached file for ``teacher``, ``student`` or ``student-int8`` of the reference
    detector pair, without building it (``bootstrap_reference_detectors`` builds).

    Raises ModelError if the pair has not been built into ``cache_dir``.
    """
    return cached_reference_file(
        alias,
        _DETECTOR_FILES,
        DetectorReferenceConfig.reference(quick=quick),
        _entry_dir,
        cache_dir,
        what="detector",
        hint="`edgeloop loop --task detection` and `python -m bench.run --only detectors`"
        " build the pair",
    )


def bootstrap_reference_detectors(
    cache_dir: Path | None = None,
    *,
    quick: bool = False,
    progress: bool = False,
    console: Console | None = None,
    config: DetectorReferenceConfig | None = None,
) -> ReferenceDetectors:
    """The reference detector pair from ``cache_dir``, building what is missing.

    ``cache_dir`` defaults to ``distill.cache.default_cache_dir()``; ``config``
    overrides the reference configuration (``quick`` picks between the built-in ones).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    cfg = config or DetectorReferenceConfig.reference(quick=quick)
    built: list[str] = []
    t_key, s_key = cfg.teacher_key(), cfg.student_key()

    t_dir = _entry_dir(cache_dir, "teacher", t_key)
    with cache_lock(cache_dir, f"det-teacher-{t_key}"):
        if not entry_complete(t_dir, "teacher"):
            with build_entry(cache_dir, _entry_dir(cache_dir, "teacher", t_key).name) as tmp:
                _build_teacher(cfg, t_key, tmp, progress=progress, console=console)
            built.append("teacher")
    s_dir = _entry_dir(cache_dir, "student", s_key)
    with cache_lock(cache_dir, f"det-student-{s_key}"):
        if not entry_complete(s_dir, "student"):
            with build_entry(cache_dir, _entry_dir(cache_dir, "student", s_key).name) as tmp:
                _build_student(cfg, s_key, t_dir, tmp, progress=progress, console=console)
            built.append("student")

    return ReferenceDetectors(
        teacher_pt=t_dir / "teacher.pt",
        teacher_onnx=t_dir / "teacher.onnx",
        student_pt=s_dir / "student.pt",
        student_onnx=s_dir / "student.onnx",
        student_int8_onnx=s_dir / "student.int8.onnx",
        metrics_json=s_dir / "metrics.json",
        class_names=DIGIT_CLASSES,
        frame_size=cfg.scenario.frame_size,
        metrics={
            "teacher": json.loads((t_dir / "metrics.json").read_text()),
            "student": json.loads((s_dir / "metrics.json").read_text()),
        },
        teacher_key=t_key,
        student_key=s_key,
        quick=quick,
        built=tuple(built),
    )
