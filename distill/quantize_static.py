"""Static INT8 quantization (QDQ, per-channel weights) of one model with ONNX Runtime.

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
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
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
from distill.export import INPUT_NAME, read_onnx_info, write_metadata
from distill.models import INPUT_SCALE, INPUT_ZERO_POINT
from shared.errors import DataError, ModelError

__all__ = [
    "DEFAULT_SETTINGS",
    "KNOWN_SETTINGS",
    "FrameCalibrationReader",
    "QuantResult",
    "QuantSettings",
    "quantize_onnx",
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
