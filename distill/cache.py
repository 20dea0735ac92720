"""The reference teacher/student pair, trained once and cached by what they were made from.

A cache entry is a folder named ``<role>-<key>``: the key hashes the source data's
identity (the digits' bytes), the scenario's render parameters, the ``TrainConfig``,
what else the model depends on (the teacher, for a distilled student) and
``CODE_VERSION``. Entries are built in a temporary folder beside the cache and
renamed into place in one step, so a reader sees a complete entry or none; a lock
file keeps two processes from training the same entry at once.

``bootstrap_reference_models(cache_dir)`` returns the pair, training only what is
missing: the teacher (drift-augmented), then the student (distilled from the
teacher on clean frames), its ONNX exports, and the INT8 student (settings chosen
by measurement in the full configuration). ``quick=True`` is a much smaller
configuration for tests: seconds, not minutes, with accuracy still far above
chance.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.console import Console

from distill._io import atomic_write_json, build_entry, cache_lock
from distill.evaluate import OnnxClassifier, evaluate
from distill.export import export_onnx
from distill.frames import FrameSet
from distill.models import ModelMeta, model_profile, save_checkpoint
from distill.quantize import DEFAULT_SETTINGS, QuantSettings, quantize_onnx, select_settings
from distill.scenario import DIGIT_CLASSES, ScenarioConfig, load_digit_sources, render_split
from distill.train import TrainConfig, TrainResult, train
from shared.errors import ModelError

__all__ = [
    "CODE_VERSION",
    "ENTRY_FILES",
    "ReferenceConfig",
    "ReferenceModels",
    "bootstrap_reference_models",
    "cache_key",
    "cached_reference_file",
    "default_cache_dir",
    "entry_complete",
    "reference_model_path",
]

# Bump whenever rendering, drifts, architectures, training or export change what a
# given configuration produces; old entries are then simply not found.
CODE_VERSION = "2026.11-3"
_NAME = "edgeloop-digits"


def default_cache_dir() -> Path:
    """``$EDGELOOP_DATA_DIR/models/cache`` if that is set, else ``~/.cache/edgeloop/models``."""
    data_dir = os.environ.get("EDGELOOP_DATA_DIR")
    if data_dir:
        return Path(data_dir).expanduser() / "models" / "cache"
    return Path.home() / ".cache" / "edgeloop" / "models"


def cache_key(parts: Mapping[str, Any]) -> str:
    """A stable hash of JSON-able parts (sorted keys, tuples as lists)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class ReferenceConfig:
    """Everything that decides the reference pair."""

    scenario: ScenarioConfig
    teacher: TrainConfig
    student: TrainConfig
    distill_student: bool = True
    # "select": quantize with every known setting and keep the fastest within
    # tolerance; "fixed": use ``quant_settings`` (quick mode).
    quant_mode: Literal["select", "fixed"] = "select"
    quant_settings: QuantSettings = DEFAULT_SETTINGS
    quant_tolerance: float = 0.01

    @classmethod
    def reference(cls, *, quick: bool = False) -> ReferenceConfig:
        if not quick:
            return cls(
                scenario=ScenarioConfig(),
                teacher=TrainConfig.for_role("teacher", epochs=16),
                student=TrainConfig.for_role("student", epochs=15),
            )
        # Quick: a quarter of the training renders, one render per scan elsewhere, a
        # half-width teacher and a few epochs: about 20 s on two cores, teacher ~95%
        # and student ~85% top-1 (chance is 10%).
        return cls(
            scenario=ScenarioConfig(train_renders=2, eval_renders=1, stream_renders=1),
            teacher=TrainConfig.for_role("teacher", epochs=6, width=0.5, lr=4e-3, p_clean=0.5),
            student=TrainConfig.for_role("student", epochs=10, lr=5e-3),
            quant_mode="fixed",
        )

    def teacher_key(self) -> str:
        return cache_key(
            {
                "kind": "teacher",
                "code": CODE_VERSION,
                "data": load_digit_sources().identity,
                "scenario": self.scenario.as_dict(),
                "train": self.teacher.cache_fields(),
            }
        )

    def student_key(self) -> str:
        return cache_key(
            {
                "kind": "student",
                "code": CODE_VERSION,
                "data": load_digit_sources().identity,
                "scenario": self.scenario.as_dict(),
                "train": self.student.cache_fields(),
                "teacher": self.teacher_key() if self.distill_student else None,
                "quant": {
                    "mode": self.quant_mode,
                    # The fixed settings matter only when they are used.
                    "settings": asdict(self.quant_settings) if self.quant_mode == "fixed" else None,
                    "tolerance": self.quant_tolerance,
                },
            }
        )


@dataclass(frozen=True)
class ReferenceModels:
    teacher_pt: Path
    teacher_onnx: Path
    student_pt: Path
    student_onnx: Path
    student_int8_onnx: Path
    class_names: tuple[str, ...]
    frame_size: int
    metrics: dict[str, Any]
    teacher_key: str
    student_key: str
    quick: bool
    built: tuple[str, ...] = field(default=())  # entries trained by this call

    def to_dict(self) -> dict[str, Any]:
        return {
            "teacher_pt": str(self.teacher_pt),
            "teacher_onnx": str(self.teacher_onnx),
            "student_pt": str(self.student_pt),
            "student_onnx": str(self.student_onnx),
            "student_int8_onnx": str(self.student_int8_onnx),
            "class_names": list(self.class_names),
            "frame_size": self.frame_size,
            "teacher_key": self.teacher_key,
            "student_key": self.student_key,
            "quick": self.quick,
            "built": list(self.built),
            "metrics": self.metrics,
        }


ENTRY_FILES = {  # what a complete entry of each role holds (detectors too)
    "teacher": ("teacher.pt", "teacher.onnx", "metrics.json"),
    "student": ("student.pt", "student.onnx", "student.int8.onnx", "metrics.json"),
}


def _entry_dir(cache_dir: Path, role: str, key: str) -> Path:
    return cache_dir / f"{role}-{key}"


def entry_complete(entry: Path, role: str) -> bool:
    """Whether a cache entry of ``role`` holds every file it should."""
    return all((entry / f).is_file() for f in ENTRY_FILES[role])


def _read_metrics(entry: Path) -> dict[str, Any]:
    return dict(json.loads((entry / "metrics.json").read_text()))


def _save_entry(
    checkpoint: Path,
    train_cfg: TrainConfig,
    result: TrainResult,
    train_set: FrameSet,
    name: str,
    version: str,
    test_accuracy: float,
    metrics: dict[str, Any],
) -> None:
    """Write a cache entry's checkpoint (with its metadata) and its metrics.json."""
    meta = ModelMeta(
        arch=train_cfg.arch,
        num_classes=train_set.num_classes,
        class_names=train_set.class_names,
        frame_size=train_cfg.frame_size,
        width=train_cfg.width,
        name=name,
        version=version,
        train_config=train_cfg.cache_fields(),
        metrics={"test_accuracy": test_accuracy, **result.metrics},
    )
    save_checkpoint(checkpoint, result.net, meta)
    atomic_write_json(checkpoint.parent / "metrics.json", metrics)


def _build_teacher(
    cfg: ReferenceConfig, key: str, out: Path, *, progress: bool, console: Console | None
) -> dict[str, Any]:
    scenario = cfg.scenario
    train_set = render_split("train", scenario)
    val_set = render_split("validation", scenario)
    test_set = render_split("test", scenario)
    name, version = f"{_NAME}-teacher", f"ref-{key[:12]}"
    result = train(
        cfg.teacher,
        train_set,
        val_set,
        name=name,
        version=version,
        progress=progress,
        console=console,
    )
    profile = model_profile(result.net, scenario.frame_size)
    export = export_onnx(
        result.net,
        out / "teacher.onnx",
        class_names=train_set.class_names,
        frame_size=scenario.frame_size,
        name=name,
        version=version,
        check_frames=test_set.frames,
    )
    test = evaluate(OnnxClassifier(out / "teacher.onnx"), test_set)
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
        "onnx_bytes": export.size_bytes,
        "test_accuracy": test.accuracy,
        "test_frames": test.frames,
        "config": cfg.teacher.cache_fields(),
    }
    _save_entry(
        out / "teacher.pt", cfg.teacher, result, train_set, name, version, test.accuracy, metrics
    )
    return metrics


def _build_student(
    cfg: ReferenceConfig,
    key: str,
    teacher_onnx: Path,
    out: Path,
    *,
    progress: bool,
    console: Console | None,
) -> dict[str, Any]:
    scenario = cfg.scenario
    train_set = render_split("train", scenario)
    val_set = render_split("validation", scenario)
    test_set = render_split("test", scenario)
    stream_set = render_split("stream", scenario)
    name, version = f"{_NAME}-student", f"ref-{key[:12]}"
    # The teacher's scores on clean training frames: the dark knowledge a 200k-
    # parameter student cannot find on its own from 1,000 scans.
    soft = OnnxClassifier(teacher_onnx).scores(train_set.frames) if cfg.distill_student else None
    result = train(
        cfg.student,
        train_set,
        val_set,
        soft_targets=soft,
        name=name,
        version=version,
        progress=progress,
        console=console,
    )
    profile = model_profile(result.net, scenario.frame_size)
    export = export_onnx(
        result.net,
        out / "student.onnx",
        class_names=train_set.class_names,
        frame_size=scenario.frame_size,
        name=name,
        version=version,
        check_frames=test_set.frames,
    )
    quant_started = time.perf_counter()
    selection: dict[str, Any] | None = None
    if cfg.quant_mode == "select":
        chosen, _ = select_settings(
            out / "student.onnx",
            stream_set.frames,
            val_set,
            out / "quant-trials",
            tolerance=cfg.quant_tolerance,
        )
        settings = chosen.chosen
        selection = {**chosen.to_dict(), "markdown": chosen.to_markdown()}
        shutil.rmtree(out / "quant-trials")
    else:
        settings = cfg.quant_settings
    quant = quantize_onnx(
        out / "student.onnx", out / "student.int8.onnx", stream_set.frames, settings
    )
    fp32_test = evaluate(OnnxClassifier(out / "student.onnx"), test_set)
    int8_test = evaluate(OnnxClassifier(out / "student.int8.onnx"), test_set)
    metrics = {
        "name": name,
        "version": version,
        "key": key,
        "train": result.metrics,
        "history": result.history,
        "params": profile["params"],
        "macs_per_frame": profile["macs"],
        "flops_per_frame": profile["flops"],
        "layers": profile["layers"],
        "export": {**export.to_dict(), "path": "student.onnx"},
        "onnx_bytes": export.size_bytes,
        "int8_bytes": quant.size_bytes,
        "int8_size_ratio": quant.size_ratio,
        "test_accuracy": fp32_test.accuracy,
        "int8_test_accuracy": int8_test.accuracy,
        "test_frames": fp32_test.frames,
        "quantization": {**quant.to_dict(), "path": "student.int8.onnx"},
        "quant_selection": selection,
        "quant_wall_s": round(time.perf_counter() - quant_started, 2),
        "distilled_from": cfg.teacher_key() if cfg.distill_student else None,
        "config": cfg.student.cache_fields(),
    }
    _save_entry(
        out / "student.pt",
        cfg.student,
        result,
        train_set,
        name,
        version,
        fp32_test.accuracy,
        metrics,
    )
    return metrics


def bootstrap_reference_models(
    cache_dir: Path | None = None,
    *,
    quick: bool = False,
    progress: bool = False,
    console: Console | None = None,
    config: ReferenceConfig | None = None,
) -> ReferenceModels:
    """The reference teacher and student from ``cache_dir``, training what is missing.

    ``cache_dir`` defaults to ``default_cache_dir()``. ``config`` overrides the
    reference configuration (``quick`` picks between the two built-in ones).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    cfg = config or ReferenceConfig.reference(quick=quick)
    if (
        cfg.teacher.frame_size != cfg.scenario.frame_size
        or cfg.student.frame_size != cfg.scenario.frame_size
    ):
        raise ModelError("teacher, student and scenario must use the same frame size")
    built: list[str] = []
    t_key, s_key = cfg.teacher_key(), cfg.student_key()

    t_dir = _entry_dir(cache_dir, "teacher", t_key)
    with cache_lock(cache_dir, f"teacher-{t_key}"):
        if not entry_complete(t_dir, "teacher"):
            with build_entry(cache_dir, _entry_dir(cache_dir, "teacher", t_key).name) as tmp:
                _build_teacher(cfg, t_key, tmp, progress=progress, console=console)
            built.append("teacher")
    s_dir = _entry_dir(cache_dir, "student", s_key)
    with cache_lock(cache_dir, f"student-{s_key}"):
        if not entry_complete(s_dir, "student"):
            with build_entry(cache_dir, _entry_dir(cache_dir, "student", s_key).name) as tmp:
                _build_student(
                    cfg, s_key, t_dir / "teacher.onnx", tmp, progress=progress, console=console
                )
            built.append("student")

    teacher_metrics, student_metrics = _read_metrics(t_dir), _read_metrics(s_dir)
    return ReferenceModels(
        teacher_pt=t_dir / "teacher.pt",
        teacher_onnx=t_dir / "teacher.onnx",
        student_pt=s_dir / "student.pt",
        student_onnx=s_dir / "student.onnx",
        student_int8_onnx=s_dir / "student.int8.onnx",
        class_names=DIGIT_CLASSES,
        frame_size=cfg.scenario.frame_size,
        metrics={
            "teacher": teacher_metrics,
            "student": student_metrics,
            "scenario": cfg.scenario.as_dict(),
            "code_version": CODE_VERSION,
        },
        teacher_key=t_key,
        student_key=s_key,
        quick=quick,
        built=tuple(built),
    )


_ALIASES = {
    "teacher": ("teacher", "teacher.onnx"),
    "teacher.pt": ("teacher", "teacher.pt"),
    "student": ("student", "student.onnx"),
    "student.pt": ("student", "student.pt"),
    "student-int8": ("student", "student.int8.onnx"),
}


def cached_reference_file(
    alias: str,
    files: dict[str, tuple[str, str]],
    cfg: Any,
    entry_dir: Callable[[Path, str, str], Path],
    cache_dir: Path | None,
    *,
    what: str,
    hint: str,
) -> Path:
    """The cached file ``files[alias]`` (role, file name) of a reference pair ``cfg``
    (its ``teacher_key``/``student_key``), without building it; ModelError naming
    ``what`` and ``hint`` (how to build it) when it is unknown or not there."""
    if alias not in files:
        raise ModelError(f"unknown reference {what} {alias!r}; known: {', '.join(files)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    role, filename = files[alias]
    key = cfg.teacher_key() if role == "teacher" else cfg.student_key()
    path = entry_dir(cache_dir, role, key) / filename
    if not path.is_file():
        raise ModelError(f"reference {what} {alias} is not in {cache_dir}; {hint}")
    return path


def reference_model_path(alias: str, cache_dir: Path | None = None, *, quick: bool = False) -> Path:
    """The cached file for ``teacher``, ``student``, ``student-int8`` (or ``*.pt``), untrained.

    Raises ModelError if the reference pair has not been bootstrapped into ``cache_dir``.
    """
    return cached_reference_file(
        alias,
        _ALIASES,
        ReferenceConfig.reference(quick=quick),
        _entry_dir,
        cache_dir,
        what="model",
        hint=f"run `edgeloop models bootstrap{' --quick' if quick else ''}` first",
    )
