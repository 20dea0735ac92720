"""Detector ONNX export (preprocessing and decoding inside the graph) and its INT8 form.

The exported contract is ``shared.tasks.detection``'s:

- input ``frames``: uint8 ``[batch, H, W, 3]``, RGB, NHWC, the camera's bytes, with a
  dynamic batch axis; transpose, cast and ``(x - 128) / 64`` happen in the graph.
- output ``detections``: float32 ``[batch, K, 6]``, rows ``x1, y1, x2, y2, score,
  class``, corners as fractions of the frame, sorted by score, padding rows zero.
- ``metadata_props``: ``edgeloop.task`` = ``detection``, ``edgeloop.labels`` (JSON
  list), ``edgeloop.name``, ``edgeloop.version``, ``edgeloop.frame_size``,
  ``edgeloop.precision`` (fp32 / int8), ``edgeloop.max_detections`` and the input's
  layout and normalisation.

``export_detector`` folds BatchNorm into the convolutions, exports at opset 17,
applies ONNX Runtime's portable BASIC optimisations and checks the file against the
unfused torch module on real and random probe frames (``detections_diff``).

``quantize_detector`` quantizes the backbone and heads to INT8 (static QDQ,
per-channel weights, calibrated on frames) and leaves the decode in float: the
sigmoid, the max-pool peak test, TopK and the gathers. Peaks on an 8-bit heatmap
would tie between neighbouring cells and double detections, so by default the final
1x1 projections (a few percent of the work) stay float as well. As for the
classifier (``distill.quantize_static``), the normalised input is pinned to scale
1/64 and zero point 128, which makes the camera byte its quantized form, and the
float preprocessing is folded away.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process
from torch import nn

from distill._io import atomic_path
from distill.detectors import MAX_DETECTIONS, OUTPUT_STRIDE, FramesDetector
from distill.export import (
    INPUT_NAME,
    OPSET,
    ort_optimize,
    read_onnx_info,
    torch_export,
    write_metadata,
)
from distill.models import INPUT_SCALE, INPUT_ZERO_POINT, fuse_conv_bn
from distill.quantize_static import DEFAULT_SETTINGS, FrameCalibrationReader, QuantSettings
from distill.quantize_static import _fold_input as fold_camera_input
from shared.errors import DataError, ModelError
from shared.tasks import DETECTION

__all__ = [
    "DETECTIONS_NAME",
    "DetExportReport",
    "DetQuantResult",
    "detections_diff",
    "export_detector",
    "quantize_detector",
    "run_detector",
]

DETECTIONS_NAME = "detections"
_PROBE_MIN_SCORE = 0.05  # rows below this are too faint to matter to any threshold
_PROBE_TIE = 1e-3  # scores this close may order either way after a graph's rounding
_TYPES = {"u8": QuantType.QUInt8, "s8": QuantType.QInt8}
_METHODS = {
    "minmax": CalibrationMethod.MinMax,
    "percentile": CalibrationMethod.Percentile,
    "entropy": CalibrationMethod.Entropy,
}


@dataclass(frozen=True)
class DetExportReport:
    path: Path
    max_diff_vs_torch: float  # final graph vs the unfused torch module (detections_diff)
    nodes_final: int
    ops_final: Mapping[str, int]
    size_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "max_diff_vs_torch": self.max_diff_vs_torch,
            "nodes_final": self.nodes_final,
            "ops_final": dict(self.ops_final),
            "size_bytes": self.size_bytes,
        }


def run_detector(path: Path, frames: np.ndarray) -> np.ndarray:
    """``detections`` of an ONNX detector on uint8 NHWC frames, in one call."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run([DETECTIONS_NAME], {INPUT_NAME: frames})[0])


def detections_diff(
    a: np.ndarray,
    b: np.ndarray,
    min_score: float = _PROBE_MIN_SCORE,
    *,
    cell: float = 0.0,
    tie: float = _PROBE_TIE,
) -> float:
    """How far two ``[N, K, 6]`` outputs are apart on the detections that matter.

    Each row scoring at least ``min_score`` in either output is paired with the row of
    the same class in the other output nearest to it (max abs difference of corners
    and score); the result is the largest such distance (inf when a class is missing).
    Pairing instead of comparing row by row tolerates two near-equal scores swapping
    places. A row is left out where the decoding's hard choices can tip on rounding
    alone (``_tipped``): its score ties (within ``tie``) the other output's last kept
    row, or a row of its class there whose centre is within ``cell`` (a heatmap cell,
    as a fraction of the frame) of its own, which won the peak instead.
    """
    if a.shape != b.shape:
        return float("inf")
    worst = 0.0
    for x, y in ((a, b), (b, a)):
        for fx, fy in zip(x, y, strict=True):
            for row in fx[fx[:, 4] >= min_score]:
                same = fy[fy[:, 5] == row[5]]
                distance = (
                    float(np.abs(same[:, :5] - row[:5]).max(axis=1).min())
                    if len(same)
                    else float("inf")
                )
                if distance > worst and not _tipped(row, fy, same, cell=cell, tie=tie):
                    worst = distance
    return worst


def _tipped(
    row: np.ndarray, other: np.ndarray, same: np.ndarray, *, cell: float, tie: float
) -> bool:
    """Whether ``row`` may be missing from ``other`` (one frame's rows) by rounding alone:
    ``other`` is full and its last row scores within ``tie`` of it (the top-K cut), or a
    row of ``same`` (its class in ``other``) within one cell of it scores within ``tie``
    (two neighbouring cells tied for the 3x3 peak)."""
    if other[-1, 4] > 0 and abs(float(other[-1, 4]) - float(row[4])) <= tie:
        return True
    if not len(same) or cell <= 0:
        return False
    centre = (row[:2] + row[2:4]) / 2
    centres = (same[:, :2] + same[:, 2:4]) / 2
    near = np.abs(centres - centre).max(axis=1) <= cell * 1.5
    return bool((near & (np.abs(same[:, 4] - row[4]) <= tie)).any())


def export_detector(
    net: nn.Module,
    path: Path,
    *,
    class_names: Sequence[str],
    frame_size: int,
    name: str,
    version: str,
    check_frames: np.ndarray | None = None,
    tolerance: float = 1e-4,
    k: int = MAX_DETECTIONS,
    opset: int = OPSET,
    extra_metadata: Mapping[str, str] | None = None,
) -> DetExportReport:
    """Export ``net`` (normalised NCHW in, maps out) as an EdgeLoop detector at ``path``.

    ``check_frames`` (uint8 NHWC) are real frames for the numeric check; random
    frames are always added. Raises ModelError if the final graph differs from the
    torch module by more than ``tolerance`` (``detections_diff``).
    """
    path = Path(path)
    num_classes = len(class_names)
    reference = FramesDetector(net, num_classes, k).eval()
    deployable = FramesDetector(fuse_conv_bn(net), num_classes, k).eval()
    rng = np.random.default_rng(0)
    probe = rng.integers(0, 256, size=(3, frame_size, frame_size, 3), dtype=np.uint8)
    if check_frames is not None and len(check_frames):
        probe = np.concatenate([np.asarray(check_frames[:32], dtype=np.uint8), probe])
    with torch.inference_mode():
        expected = reference(torch.from_numpy(probe.copy())).numpy()

    with tempfile.TemporaryDirectory(prefix="edgeloop-det-export-") as tmp:
        raw, optimized = Path(tmp) / "raw.onnx", Path(tmp) / "optimized.onnx"
        try:
            torch_export(deployable, raw, frame_size, opset, DETECTIONS_NAME)
            ort_optimize(raw, optimized)
        except Exception as exc:
            raise ModelError(f"ONNX export of {name} failed: {exc}") from exc
        model = onnx.load(str(optimized))
        model.producer_name = "edgeloop"
        model.doc_string = (
            f"{name} {version}: uint8 NHWC RGB frames -> {DETECTIONS_NAME} [batch, {k}, 6]"
            f" ({num_classes} classes)"
        )
        write_metadata(
            model,
            {
                "task": DETECTION.name,
                "name": name,
                "version": version,
                "labels": json.dumps(list(class_names)),
                "frame_size": str(frame_size),
                "precision": "fp32",
                "max_detections": str(k),
                "output": f"{DETECTIONS_NAME}: float32 [batch, {k}, 6] x1 y1 x2 y2 (fractions)"
                " score class, by score",
                "input": f"{INPUT_NAME}: uint8 [batch, {frame_size}, {frame_size}, 3] RGB NHWC",
                "input_zero_point": f"{INPUT_ZERO_POINT:g}",
                "input_scale": f"{INPUT_SCALE!r}",
                **(extra_metadata or {}),
            },
        )
        onnx.checker.check_model(model)
        final = Path(tmp) / "final.onnx"
        onnx.save(model, str(final))
        cell = OUTPUT_STRIDE / frame_size
        diff = detections_diff(run_detector(final, probe), expected, cell=cell)
        if diff > tolerance:
            raise ModelError(
                f"exported {name} does not match its torch module: detections differ by"
                f" {diff:.2e} (tolerance {tolerance:.0e})"
            )
        with atomic_path(path) as out:
            out.write_bytes(final.read_bytes())
    return DetExportReport(
        path=path,
        max_diff_vs_torch=diff,
        nodes_final=len(model.graph.node),
        ops_final=dict(Counter(n.op_type for n in model.graph.node)),
        size_bytes=path.stat().st_size,
    )


# ---------------------------------------------------------------------------------
# INT8


@dataclass(frozen=True)
class DetQuantResult:
    path: Path
    settings: QuantSettings
    size_bytes: int
    fp32_size_bytes: int
    folded_input: bool
    quantized_nodes: int
    float_convs: int
    calibration_frames: int
    ops: dict[str, int]
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "settings": self.settings.label,
            "settings_detail": asdict(self.settings),
            "size_bytes": self.size_bytes,
            "fp32_size_bytes": self.fp32_size_bytes,
            "size_ratio": round(self.size_bytes / self.fp32_size_bytes, 4),
            "folded_input": self.folded_input,
            "quantized_nodes": self.quantized_nodes,
            "float_convs": self.float_convs,
            "calibration_frames": self.calibration_frames,
            "ops": self.ops,
            "wall_s": round(self.wall_s, 2),
        }


def _backbone_nodes(model: onnx.ModelProto, *, include_outputs: bool) -> list[str]:
    """Names of the nodes to quantize: everything from the first Conv up to the last ones.

    The last convolutions are those with no convolution downstream (the head
    projections); what follows them is the decode. Preprocessing before the first
    Conv stays out (it is folded away afterwards).
    """
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def reach(start: onnx.NodeProto, step: str) -> set[str]:
        seen: set[str] = set()
        stack = [start]
        while stack:
            node = stack.pop()
            nexts = (
                [producer[i] for i in node.input if i in producer]
                if step == "up"
                else [c for o in node.output for c in consumers.get(o, [])]
            )
            for m in nexts:
                if m.name not in seen:
                    seen.add(m.name)
                    stack.append(m)
        return seen

    convs = [n for n in g.node if n.op_type == "Conv"]
    if not convs:
        raise ModelError("the detector graph has no convolution to quantize")
    conv_names = {n.name for n in convs}
    last = [n for n in convs if not reach(n, "down") & conv_names]
    preprocessing = reach(convs[0], "up")
    keep: set[str] = set()
    for node in last:
        keep |= reach(node, "up") - preprocessing
        if include_outputs:
            keep.add(node.name)
    return [n.name for n in g.node if n.name in keep]


def quantize_detector(
    fp32_path: Path,
    out_path: Path,
    calibration: np.ndarray,
    settings: QuantSettings = DEFAULT_SETTINGS,
    *,
    quantize_outputs: bool = False,
    max_calibration_frames: int = 256,
    batch_size: int = 16,
) -> DetQuantResult:
    """Quantize an EdgeLoop FP32 detector to INT8 (QDQ), calibrated on uint8 NHWC frames."""
    started = time.perf_counter()
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    info = read_onnx_info(fp32_path)
    if info.precision != "fp32" or info.metadata.get("task") != DETECTION.name:
        raise ModelError(f"{fp32_path} is not an FP32 detector ({info.precision})")
    frames = np.asarray(calibration)
    if frames.ndim != 4 or frames.shape[1:] != (info.frame_size, info.frame_size, 3):
        raise DataError(
            f"calibration frames must be uint8 [N, {info.frame_size}, {info.frame_size}, 3],"
            f" got {frames.dtype} {frames.shape}"
        )
    if len(frames) > max_calibration_frames:
        pick = np.random.default_rng(0).choice(len(frames), max_calibration_frames, replace=False)
        frames = frames[np.sort(pick)]

    with tempfile.TemporaryDirectory(prefix="edgeloop-det-quant-") as tmp:
        pre, quant = Path(tmp) / "pre.onnx", Path(tmp) / "int8.onnx"
        try:
            quant_pre_process(str(fp32_path), str(pre), skip_symbolic_shape=True)
            pre_model = onnx.load(str(pre))
            nodes = _backbone_nodes(pre_model, include_outputs=quantize_outputs)
            extra: dict[str, Any] = {}
            first_conv = next(n for n in pre_model.graph.node if n.op_type == "Conv")
            if settings.fold_input and settings.activations == "u8":
                # The camera byte is the normalised input quantized at (1/64, 128).
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
                nodes_to_quantize=nodes,
                calibrate_method=_METHODS[settings.calibration],
                extra_options=extra,
            )
        except (DataError, ModelError):
            raise
        except Exception as exc:
            raise ModelError(f"quantization of {fp32_path} failed: {exc}") from exc
        model = onnx.load(str(quant))
        folded = settings.fold_input and settings.activations == "u8" and fold_camera_input(model)
        write_metadata(
            model,
            {
                "precision": "int8",
                "quantization": json.dumps(
                    {
                        **asdict(settings),
                        "label": settings.label,
                        "folded_input": folded,
                        "float_outputs": not quantize_outputs,
                    }
                ),
                "fp32_version": info.version,
            },
        )
        onnx.checker.check_model(model)
        with atomic_path(out_path) as final:
            onnx.save(model, str(final))
    ops = dict(Counter(n.op_type for n in model.graph.node))
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    float_convs = sum(
        1
        for n in model.graph.node
        if n.op_type == "Conv" and producer.get(n.input[1]) != "DequantizeLinear"
    )
    return DetQuantResult(
        path=out_path,
        settings=settings,
        size_bytes=out_path.stat().st_size,
        fp32_size_bytes=fp32_path.stat().st_size,
        folded_input=folded,
        quantized_nodes=len(nodes),
        float_convs=float_convs,
        calibration_frames=len(frames),
        ops=ops,
        wall_s=time.perf_counter() - started,
    )
