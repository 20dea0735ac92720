"""Static INT8 quantization (QDQ, per-channel weights) with ONNX Runtime, and choosing how.

Pipeline for one setting: ORT's ``quant_pre_process`` (shape inference and
optimisation, so calibration sees the graph that will run), then ``quantize_static``
calibrated on frames (``FrameCalibrationReader``), then two deliberate edits:

- **Preprocessing stays float and is then folded away.** The in-graph preprocessing
  (Cast, ``- 128``, ``* 1/64``) and the final Softmax are excluded from quantization:
  8-bit probabilities would be too coarse for confidence routing. With unsigned
  8-bit activations the normalised input quantized at zero point 128 and scale 1/64
  *is* the camera byte, so ``fold_input`` replaces Cast -> Sub -> Mul -> QuantizeLinear
  by nothing: the uint8 frame feeds the first DequantizeLinear directly. Exact, and
  it removes three float passes over the frame.
- The ``edgeloop.*`` metadata of the FP32 model is carried over, with
  ``precision=int8`` and the settings used.

``select_settings`` quantizes with each known setting (activation/weight types
U8S8, S8S8, with and without ``reduce_range``), measures accuracy and latency side
by side, and keeps the fastest setting whose accuracy is within the tolerance of
FP32.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)
from onnxruntime.quantization.shape_inference import quant_pre_process

from distill._io import atomic_path
from distill.datasets import DIGITS, LoadedData, load_data
from distill.export import INPUT_NAME, read_onnx_info, write_metadata
from distill.frames import FrameSet
from distill.models import INPUT_SCALE, INPUT_ZERO_POINT
from shared.errors import DataError, ModelError

__all__ = [
    "DEFAULT_SETTINGS",
    "KNOWN_SETTINGS",
    "FrameCalibrationReader",
    "QuantFrames",
    "QuantResult",
    "QuantSelection",
    "QuantSettings",
    "SettingsTrial",
    "quantization_frames",
    "quantize_onnx",
    "select_settings",
]

_TYPES = {"u8": QuantType.QUInt8, "s8": QuantType.QInt8}
_METHODS = {
    "minmax": CalibrationMethod.MinMax,
    "percentile": CalibrationMethod.Percentile,
    "entropy": CalibrationMethod.Entropy,
}


@dataclass(frozen=True)
class QuantSettings:
    activations: Literal["u8", "s8"] = "u8"
    weights: Literal["u8", "s8"] = "s8"
    reduce_range: bool = False
    calibration: Literal["minmax", "percentile", "entropy"] = "minmax"
    per_channel: bool = True
    fold_input: bool = True

    def __post_init__(self) -> None:
        if self.activations not in _TYPES or self.weights not in _TYPES:
            raise ModelError("activation and weight types must be 'u8' or 's8'")
        if self.calibration not in _METHODS:
            raise ModelError(f"calibration must be one of {', '.join(_METHODS)}")

    @property
    def label(self) -> str:
        rr = "+reduce_range" if self.reduce_range else ""
        return f"{self.activations.upper()}{self.weights.upper()}{rr}"

    @classmethod
    def parse(cls, text: str) -> QuantSettings:
        """``u8s8``, ``s8s8``, optionally ``+rr`` / ``+reduce_range`` (case-insensitive)."""
        t = text.strip().lower().replace("-", "+")
        base, _, rest = t.partition("+")
        if len(base) != 4 or base[:2] not in _TYPES or base[2:] not in _TYPES:
            raise ModelError(
                f"bad quantization setting {text!r}: expected e.g. u8s8, s8s8, u8s8+rr"
            )
        if rest not in ("", "rr", "reduce_range"):
            raise ModelError(f"bad quantization option {rest!r} in {text!r}: only +rr is known")
        return cls(activations=base[:2], weights=base[2:], reduce_range=bool(rest))  # type: ignore[arg-type]


KNOWN_SETTINGS: tuple[QuantSettings, ...] = (
    QuantSettings("u8", "s8", False),
    QuantSettings("u8", "s8", True),
    QuantSettings("s8", "s8", False),
    QuantSettings("s8", "s8", True),
)
# The measured winner on the reference student (bench/models.py): unsigned activations
# let the camera byte feed the first conv directly (U8S8 runs faster than S8S8 here:
# docs/performance.md, models),
# and reduce_range (7-bit weights) costs no speed with VNNI while keeping AVX2 CPUs
# without VNNI clear of the int16 saturation in their u8 x s8 multiply-add.
DEFAULT_SETTINGS = KNOWN_SETTINGS[1]


class FrameCalibrationReader(CalibrationDataReader):
    """Feeds uint8 NHWC frames to the calibrator in equal batches.

    A ragged last batch is dropped when there is at least one full batch: ORT's
    histogram calibrators (percentile, entropy) cannot stack unequal batches.
    """

    def __init__(
        self, frames: np.ndarray, *, batch_size: int = 32, input_name: str = INPUT_NAME
    ) -> None:
        if len(frames) == 0:
            raise DataError("calibration needs at least one frame")
        if len(frames) >= batch_size:
            frames = frames[: len(frames) - len(frames) % batch_size]
        self.frames = np.ascontiguousarray(frames, dtype=np.uint8)
        self.batch_size = batch_size
        self.input_name = input_name
        self._pos = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._pos >= len(self.frames):
            return None
        batch = self.frames[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return {self.input_name: batch}

    def rewind(self) -> None:
        self._pos = 0


@dataclass(frozen=True)
class QuantResult:
    path: Path
    settings: QuantSettings
    size_bytes: int
    fp32_size_bytes: int
    folded_input: bool
    excluded_nodes: tuple[str, ...]
    calibration_frames: int
    ops: dict[str, int]
    wall_s: float

    @property
    def size_ratio(self) -> float:
        return self.size_bytes / self.fp32_size_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "settings": self.settings.label,
            "settings_detail": asdict(self.settings),
            "size_bytes": self.size_bytes,
            "fp32_size_bytes": self.fp32_size_bytes,
            "size_ratio": round(self.size_ratio, 4),
            "folded_input": self.folded_input,
            "excluded_nodes": list(self.excluded_nodes),
            "calibration_frames": self.calibration_frames,
            "ops": self.ops,
            "wall_s": round(self.wall_s, 2),
        }


def _preprocessing_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the float preprocessing before the first Conv, and every Softmax."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    first_conv = next((n for n in g.node if n.op_type == "Conv"), None)
    names: list[str] = [n.name for n in g.node if n.op_type == "Softmax"]
    if first_conv is None:
        return names
    stack, seen = [first_conv.input[0]], set()
    while stack:
        tensor = stack.pop()
        node = producer.get(tensor)
        if node is None or node.name in seen:
            continue
        if node.op_type not in ("Cast", "Sub", "Mul", "Div", "Add", "Transpose"):
            break
        seen.add(node.name)
        names.append(node.name)
        stack.extend(node.input[:1])
    return names


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
    return None


def _fold_input(model: onnx.ModelProto) -> bool:
    """Drop uint8 -> Cast -> Sub(128) -> Mul(1/64) -> QuantizeLinear(1/64, 128).

    That chain maps a camera byte to itself, so its DequantizeLinear consumers can read
    the uint8 tensor directly. Returns False, graph untouched, unless the exact
    pattern (constants included) is found.
    """
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def only_child(op: str, tensor: str) -> onnx.NodeProto | None:
        node = producer.get(tensor)
        if node is None or node.op_type != op or len(consumers.get(node.output[0], [])) != 1:
            return None
        return node

    def const_is(name: str, value: float, dtype: type | None = None) -> bool:
        arr = _constant(model, name)
        ok = arr is not None and arr.size == 1 and bool(np.isclose(float(arr.item()), value))
        return ok and (dtype is None or (arr is not None and arr.dtype == dtype))

    for q in [n for n in g.node if n.op_type == "QuantizeLinear" and len(n.input) == 3]:
        mul = only_child("Mul", q.input[0])
        sub = only_child("Sub", mul.input[0]) if mul else None
        cast = only_child("Cast", sub.input[0]) if sub else None
        if mul is None or sub is None or cast is None:
            continue
        if not (
            const_is(mul.input[1], INPUT_SCALE)
            and const_is(sub.input[1], INPUT_ZERO_POINT)
            and const_is(q.input[1], INPUT_SCALE)
            and const_is(q.input[2], INPUT_ZERO_POINT, np.uint8)
        ):
            continue
        dqs = consumers.get(q.output[0], [])
        if not dqs or any(dq.op_type != "DequantizeLinear" for dq in dqs):
            continue
        for dq in dqs:
            dq.input[0] = cast.input[0]  # the uint8 frame (after its transpose)
        removed = (q, mul, sub, cast)
        for node in removed:
            g.node.remove(node)
        stale = {o for node in removed for o in node.output}
        kept_info = [v for v in g.value_info if v.name not in stale]
        del g.value_info[:]
        g.value_info.extend(kept_info)
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if n.op_type == "Constant" and n.output[0] not in used]
        for node in dead:
            g.node.remove(node)
        kept_init = [i for i in g.initializer if i.name in used]
        del g.initializer[:]
        g.initializer.extend(kept_init)
        return True
    return False


def quantize_onnx(
    fp32_path: Path,
    out_path: Path,
    calibration: np.ndarray,
    settings: QuantSettings = DEFAULT_SETTINGS,
    *,
    max_calibration_frames: int = 512,
    batch_size: int = 32,
) -> QuantResult:
    """Quantize an EdgeLoop FP32 ONNX model to INT8 (QDQ), calibrated on uint8 NHWC frames."""
    started = time.perf_counter()
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    info = read_onnx_info(fp32_path)
    if info.precision != "fp32":
        raise ModelError(f"{fp32_path} is already {info.precision}; quantize the FP32 model")
    frames = np.asarray(calibration)
    if frames.ndim != 4 or frames.shape[1:] != (info.frame_size, info.frame_size, 3):
        raise DataError(
            f"calibration frames must be uint8 [N, {info.frame_size}, {info.frame_size}, 3],"
            f" got {frames.dtype} {frames.shape}"
        )
    if len(frames) > max_calibration_frames:
        pick = np.random.default_rng(0).choice(len(frames), max_calibration_frames, replace=False)
        frames = frames[np.sort(pick)]

    with tempfile.TemporaryDirectory(prefix="edgeloop-quant-") as tmp:
        pre, quant = Path(tmp) / "pre.onnx", Path(tmp) / "int8.onnx"
        try:
            quant_pre_process(str(fp32_path), str(pre))
            pre_model = onnx.load(str(pre))
            excluded = _preprocessing_nodes(pre_model)
            extra: dict[str, Any] = {}
            first_conv = next((n for n in pre_model.graph.node if n.op_type == "Conv"), None)
            if settings.fold_input and settings.activations == "u8" and first_conv is not None:
                # Pin the normalised input's quantization to what the camera byte already
                # is (scale 1/64, zero point 128) instead of a calibrated range, so the
                # first conv's int32 bias is quantized against that scale and the
                # Q/DQ pair can later be dropped without unfusing QLinearConv.
                extra["TensorQuantOverrides"] = {
                    first_conv.input[0]: [
                        {
                            "scale": np.array(INPUT_SCALE, dtype=np.float32),
                            "zero_point": np.array(INPUT_ZERO_POINT, dtype=np.uint8),
                        }
                    ]
                }
            quantize_static(
                str(pre),
                str(quant),
                FrameCalibrationReader(frames, batch_size=batch_size),
                quant_format=QuantFormat.QDQ,
                per_channel=settings.per_channel,
                reduce_range=settings.reduce_range,
                activation_type=_TYPES[settings.activations],
                weight_type=_TYPES[settings.weights],
                nodes_to_exclude=excluded,
                calibrate_method=_METHODS[settings.calibration],
                extra_options=extra,
            )
        except (DataError, ModelError):
            raise
        except Exception as exc:
            raise ModelError(f"quantization of {fp32_path} failed: {exc}") from exc
        model = onnx.load(str(quant))
        folded = settings.fold_input and settings.activations == "u8" and _fold_input(model)
        write_metadata(
            model,
            {
                "precision": "int8",
                "quantization": json.dumps(
                    {**asdict(settings), "label": settings.label, "folded_input": folded}
                ),
                "fp32_version": info.version,
            },
        )
        onnx.checker.check_model(model)
        with atomic_path(out_path) as final:
            onnx.save(model, str(final))
    return QuantResult(
        path=out_path,
        settings=settings,
        size_bytes=out_path.stat().st_size,
        fp32_size_bytes=fp32_path.stat().st_size,
        folded_input=folded,
        excluded_nodes=tuple(excluded),
        calibration_frames=len(frames),
        ops=dict(Counter(n.op_type for n in model.graph.node)),
        wall_s=time.perf_counter() - started,
    )


@dataclass(frozen=True)
class SettingsTrial:
    settings: QuantSettings
    accuracy: float
    size_bytes: int
    folded_input: bool
    latency_ms: dict[int, float]  # batch -> median ms per batch
    speedup: dict[int, float]  # batch -> FP32 latency / this latency
    meets_accuracy: bool

    @property
    def score(self) -> float:
        """Geometric mean speed-up over the measured batch sizes."""
        vals = list(self.speedup.values())
        return float(np.exp(np.mean(np.log(vals)))) if vals else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings.label,
            "accuracy": self.accuracy,
            "size_bytes": self.size_bytes,
            "folded_input": self.folded_input,
            "latency_ms": {str(b): v for b, v in self.latency_ms.items()},
            "speedup_vs_fp32": {str(b): v for b, v in self.speedup.items()},
            "score": round(self.score, 3),
            "meets_accuracy": self.meets_accuracy,
        }


@dataclass(frozen=True)
class QuantSelection:
    chosen: QuantSettings
    fp32_accuracy: float
    fp32_latency_ms: dict[int, float]
    trials: tuple[SettingsTrial, ...]
    tolerance: float
    reason: str
    threads: int
    eval_frames: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.label,
            "reason": self.reason,
            "fp32_accuracy": self.fp32_accuracy,
            "fp32_latency_ms": {str(b): v for b, v in self.fp32_latency_ms.items()},
            "tolerance": self.tolerance,
            "threads": self.threads,
            "eval_frames": self.eval_frames,
            "trials": [t.to_dict() for t in self.trials],
        }

    def to_markdown(self) -> str:
        batches = sorted(self.fp32_latency_ms)
        head = (
            "| setting | top-1 % | size KB | "
            + " | ".join(f"ms b{b} | x FP32 b{b}" for b in batches)
            + " | within bound | chosen |"
        )
        rule = "|---|---:|---:|" + "---:|---:|" * len(batches) + "---|---|"
        fp32 = (
            f"| FP32 | {100 * self.fp32_accuracy:.2f} | - | "
            + " | ".join(f"{self.fp32_latency_ms[b]:.3f} | 1.00" for b in batches)
            + " | - | |"
        )
        rows = [head, rule, fp32]
        for t in self.trials:
            lat = " | ".join(f"{t.latency_ms[b]:.3f} | {t.speedup[b]:.2f}" for b in batches)
            ok = "yes" if t.meets_accuracy else "no"
            chosen = "**yes**" if t.settings == self.chosen else ""
            rows.append(
                f"| {t.settings.label} | {100 * t.accuracy:.2f} | {t.size_bytes / 1024:.0f}"
                f" | {lat} | {ok} | {chosen} |"
            )
        return "\n".join(rows)


def select_settings(
    fp32_path: Path,
    calibration: np.ndarray,
    eval_set: FrameSet,
    out_dir: Path,
    *,
    candidates: Sequence[QuantSettings] = KNOWN_SETTINGS,
    tolerance: float = 0.01,
    threads: int = 1,
    batches: Sequence[int] = (1, 8),
    repeats: int = 5,
    speed_noise: float = 0.03,
) -> tuple[QuantSelection, dict[QuantSettings, Path]]:
    """Quantize with every candidate; keep the fastest within ``tolerance`` of FP32 top-1.

    Accuracy is measured on ``eval_set`` (use a held-out split, not the calibration
    frames); latency side by side with FP32 at each batch size, ``threads`` intra-op
    threads, median of ``repeats``. Returns the selection and each candidate's file.
    """
    from distill.evaluate import OnnxClassifier, accuracy
    from distill.speed import compare_latency, ort_runner

    out_dir.mkdir(parents=True, exist_ok=True)
    fp32_acc = accuracy(OnnxClassifier(fp32_path), eval_set)
    paths: dict[QuantSettings, Path] = {}
    results: dict[QuantSettings, QuantResult] = {}
    accs: dict[QuantSettings, float] = {}
    for s in candidates:
        path = out_dir / f"int8-{s.label.replace('+', '-').lower()}.onnx"
        results[s] = quantize_onnx(fp32_path, path, calibration, s)
        paths[s] = path
        accs[s] = accuracy(OnnxClassifier(path), eval_set)

    rng = np.random.default_rng(0)
    fp32_lat: dict[int, float] = {}
    lat: dict[QuantSettings, dict[int, float]] = {s: {} for s in candidates}
    for b in batches:
        frames = eval_set.frames[rng.choice(len(eval_set), b, replace=len(eval_set) < b)]
        runners = {"fp32": ort_runner(fp32_path, threads)}
        runners.update({s.label: ort_runner(paths[s], threads) for s in candidates})
        timing = compare_latency(runners, frames, threads=threads, repeats=repeats)
        fp32_lat[b] = timing["fp32"].median_s * 1e3
        for s in candidates:
            lat[s][b] = timing[s.label].median_s * 1e3

    trials = tuple(
        SettingsTrial(
            settings=s,
            accuracy=accs[s],
            size_bytes=results[s].size_bytes,
            folded_input=results[s].folded_input,
            latency_ms={b: round(v, 4) for b, v in lat[s].items()},
            speedup={b: round(fp32_lat[b] / lat[s][b], 3) for b in batches},
            meets_accuracy=accs[s] >= fp32_acc - tolerance,
        )
        for s in candidates
    )
    eligible = [t for t in trials if t.meets_accuracy]
    if eligible:
        fastest = max(t.score for t in eligible)
        # Settings within timing noise of the fastest count as equally fast; among
        # those the most accurate wins (then the faster).
        tied = [t for t in eligible if t.score >= fastest * (1.0 - speed_noise)]
        best = max(tied, key=lambda t: (t.accuracy, t.score))
        others = ", ".join(
            f"{t.settings.label} {t.score:.2f}x/{100 * t.accuracy:.2f}%"
            for t in trials
            if t is not best
        )
        reason = (
            f"{best.settings.label}: the fastest setting within {100 * tolerance:.1f} points of"
            f" FP32 (speed-up {best.score:.2f}x, geometric mean over batches {list(batches)};"
            f" settings within {100 * speed_noise:.0f}% of the fastest count as tied and the"
            f" more accurate of those wins; validation top-1 {100 * best.accuracy:.2f}%."
            f" Others: {others})"
        )
    else:
        best = max(trials, key=lambda t: t.accuracy)
        reason = (
            f"no setting is within {100 * tolerance:.1f} points of FP32;"
            f" kept the most accurate, {best.settings.label}"
        )
    selection = QuantSelection(
        chosen=best.settings,
        fp32_accuracy=fp32_acc,
        fp32_latency_ms={b: round(v, 4) for b, v in fp32_lat.items()},
        trials=trials,
        tolerance=tolerance,
        reason=reason,
        threads=threads,
        eval_frames=len(eval_set),
    )
    return selection, paths


@dataclass(frozen=True)
class QuantFrames:
    """The frames a quantization run uses, each set for one purpose: ``calibration`` sets
    the activation ranges, ``selection`` compares settings (``auto``), and ``held_out``
    is what the reported accuracy is measured on; never a calibration frame."""

    calibration: LoadedData
    selection: LoadedData
    held_out: LoadedData

    @property
    def note(self) -> str:
        """Which frames were used, for the report."""
        h, c = self.held_out, self.calibration
        return (
            f"{h.split} split of {h.source} ({len(h.frames)} frames, held out;"
            f" calibrated on its {c.split} split, {len(c.frames)} frames)"
        )


def _split_or_none(source: str, split: str, frame_size: int, format: str) -> LoadedData | None:
    try:
        return load_data(source, split=split, frame_size=frame_size, format=format)
    except DataError as exc:
        if "no readable images in split" in exc.message:
            return None
        raise


def quantization_frames(source: str, *, frame_size: int, format: str = "auto") -> QuantFrames:
    """Calibration, selection and held-out frames from ``digits`` or a labelled dataset.

    ``digits``: the stream split calibrates, validation selects, test is held out. A
    dataset: its train split calibrates (validation when it has no train split), and
    accuracy is reported on its test split (else its validation split), which
    ``edgeloop models train`` never trained on either.
    """
    if str(source) == DIGITS:
        return QuantFrames(
            calibration=load_data(DIGITS, split="stream", frame_size=frame_size),
            selection=load_data(DIGITS, split="validation", frame_size=frame_size),
            held_out=load_data(DIGITS, split="test", frame_size=frame_size),
        )
    parts = {
        s: _split_or_none(source, s, frame_size, format) for s in ("train", "validation", "test")
    }
    calibration = parts["train"] or parts["validation"]
    rest = [
        d for d in (parts["test"], parts["validation"]) if d is not None and d is not calibration
    ]
    if calibration is None or not rest:
        have = ", ".join(f"{s} {0 if d is None else len(d.frames)}" for s, d in parts.items())
        raise DataError(
            f"{source} cannot give both calibration frames and held-out frames to report"
            f" accuracy on (frames per split: {have}); quantize calibrates on the train split"
            " and reports on the test or validation split"
        )
    held_out = rest[0]
    validation = parts["validation"]
    selection = validation if validation is not None and validation is not calibration else held_out
    return QuantFrames(calibration=calibration, selection=selection, held_out=held_out)
