"""ONNX export with preprocessing inside the graph, graph optimisation, and a numeric check.

The exported contract (every EdgeLoop model, FP32 or INT8):

- input ``frames``: uint8 ``[batch, H, W, 3]``, RGB, NHWC, the camera's bytes; the
  batch axis is dynamic. Transpose, cast and normalisation ``(x - 128) / 64``
  happen inside the graph.
- output ``scores``: float32 ``[batch, classes]``, **probabilities** (softmax inside the
  graph, rows sum to 1). Routing on the edge reads confidence and margin straight off
  them; distillation recovers tempered teacher distributions from them exactly.
- ``metadata_props``: ``edgeloop.task`` (``classification``: ``shared.tasks``),
  ``edgeloop.labels`` (JSON list, index = class id), ``edgeloop.name``,
  ``edgeloop.version``, ``edgeloop.frame_size``, ``edgeloop.precision`` (fp32 / int8),
  ``edgeloop.scores`` (``probabilities``), input layout and normalisation constants.

Optimisation happens twice, on purpose: BatchNorm is folded into the convolutions in
torch before export (so the graph never contains it), torch folds constants during
export, and ONNX Runtime's offline BASIC level (constant folding, redundant-node
elimination, Conv+Add/Mul fusions: ONNX-standard ops only, so the file stays portable
to TensorRT and other providers) is applied and saved. The final file is checked
against the unfused torch model and against the unoptimised export.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from distill._io import atomic_path
from distill.models import INPUT_SCALE, INPUT_ZERO_POINT, FramesModel, fuse_conv_bn
from shared.errors import ModelError
from shared.tasks import CLASSIFICATION

__all__ = [
    "INPUT_NAME",
    "OPSET",
    "OUTPUT_NAME",
    "SCORES_KIND",
    "ExportReport",
    "OnnxModelInfo",
    "export_onnx",
    "ort_optimize",
    "read_onnx_info",
    "torch_export",
    "write_metadata",
]

INPUT_NAME = "frames"
OUTPUT_NAME = "scores"
SCORES_KIND = "probabilities"
OPSET = 17
_PREFIX = "edgeloop."


@dataclass(frozen=True)
class OnnxModelInfo:
    """What an EdgeLoop ONNX file says about itself."""

    path: Path
    name: str
    version: str
    labels: tuple[str, ...]
    frame_size: int
    precision: str
    scores: str
    opset: int
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportReport:
    path: Path
    max_abs_diff_vs_torch: float  # final graph vs the unfused torch model
    max_abs_diff_vs_unoptimized: float  # final graph vs the raw export
    nodes_unoptimized: int
    nodes_final: int
    ops_final: Mapping[str, int]
    size_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "max_abs_diff_vs_torch": self.max_abs_diff_vs_torch,
            "max_abs_diff_vs_unoptimized": self.max_abs_diff_vs_unoptimized,
            "nodes_unoptimized": self.nodes_unoptimized,
            "nodes_final": self.nodes_final,
            "ops_final": dict(self.ops_final),
            "size_bytes": self.size_bytes,
        }


def write_metadata(model: onnx.ModelProto, entries: Mapping[str, str]) -> None:
    """Set ``edgeloop.*`` metadata entries, replacing any with the same key."""
    keys = {f"{_PREFIX}{k}" if not k.startswith(_PREFIX) else k: str(v) for k, v in entries.items()}
    kept = [p for p in model.metadata_props if p.key not in keys]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in keys.items():
        model.metadata_props.add(key=key, value=value)


def read_onnx_info(path: Path) -> OnnxModelInfo:
    """Read the ``edgeloop.*`` metadata of a model file; ModelError if it is not ours."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no ONNX model at {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"cannot read ONNX model {path}: {exc}") from exc
    meta = {p.key: p.value for p in model.metadata_props}
    if f"{_PREFIX}labels" not in meta:
        raise ModelError(
            f"{path} has no {_PREFIX}labels metadata; export EdgeLoop models with distill.export"
        )
    try:
        labels = tuple(str(x) for x in json.loads(meta[f"{_PREFIX}labels"]))
        frame_size = int(meta[f"{_PREFIX}frame_size"])
    except (ValueError, KeyError) as exc:
        raise ModelError(f"{path} has malformed {_PREFIX}* metadata: {exc}") from exc
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return OnnxModelInfo(
        path=path,
        name=meta.get(f"{_PREFIX}name", path.stem),
        version=meta.get(f"{_PREFIX}version", "0"),
        labels=labels,
        frame_size=frame_size,
        precision=meta.get(f"{_PREFIX}precision", "fp32"),
        scores=meta.get(f"{_PREFIX}scores", SCORES_KIND),
        opset=int(opset),
        metadata={k.removeprefix(_PREFIX): v for k, v in meta.items() if k.startswith(_PREFIX)},
    )


def torch_export(
    model: nn.Module, path: Path, frame_size: int, opset: int, output_name: str = OUTPUT_NAME
) -> None:
    """Export a uint8 NHWC ``frames`` -> ``output_name`` module, batch axis dynamic."""
    dummy = torch.zeros(2, frame_size, frame_size, 3, dtype=torch.uint8)
    with warnings.catch_warnings():
        # The TorchScript exporter is deprecated in favour of the dynamo one, which
        # needs onnxscript; these notices are about that (and tracing a decode whose
        # shapes depend on the frame size) and nothing else.
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(
            model,
            (dummy,),
            str(path),
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[output_name],
            dynamic_axes={INPUT_NAME: {0: "batch"}, output_name: {0: "batch"}},
            opset_version=opset,
            do_constant_folding=True,
        )


def ort_optimize(src: Path, dst: Path) -> None:
    """ONNX Runtime's offline BASIC optimisation of ``src``, saved as ``dst``."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(dst)
    so.log_severity_level = 3
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])


def _run(path: Path, frames: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run([OUTPUT_NAME], {INPUT_NAME: frames})[0])


def export_onnx(
    net: nn.Module,
    path: Path,
    *,
    class_names: Sequence[str],
    frame_size: int,
    name: str,
    version: str,
    check_frames: np.ndarray | None = None,
    tolerance: float = 1e-4,
    opset: int = OPSET,
    extra_metadata: Mapping[str, str] | None = None,
) -> ExportReport:
    """Export ``net`` (a network taking normalised NCHW) as an EdgeLoop ONNX file at ``path``.

    ``check_frames`` (uint8 NHWC) are real frames for the numeric check; random
    frames are always added. Raises ModelError if the optimised graph differs from
    torch or from the unoptimised export by more than ``tolerance``.
    """
    path = Path(path)
    reference = FramesModel(net).eval()
    deployable = FramesModel(fuse_conv_bn(net)).eval()
    rng = np.random.default_rng(0)
    probe = rng.integers(0, 256, size=(4, frame_size, frame_size, 3), dtype=np.uint8)
    if check_frames is not None and len(check_frames):
        probe = np.concatenate([np.asarray(check_frames[:60], dtype=np.uint8), probe])
    with torch.inference_mode():
        expected = reference(torch.from_numpy(probe.copy())).numpy()

    with tempfile.TemporaryDirectory(prefix="edgeloop-export-") as tmp:
        raw, optimized = Path(tmp) / "raw.onnx", Path(tmp) / "optimized.onnx"
        try:
            torch_export(deployable, raw, frame_size, opset)
            ort_optimize(raw, optimized)
        except Exception as exc:
            raise ModelError(f"ONNX export of {name} failed: {exc}") from exc
        model = onnx.load(str(optimized))
        nodes_raw = len(onnx.load(str(raw)).graph.node)
        model.producer_name = "edgeloop"
        model.doc_string = (
            f"{name} {version}: uint8 NHWC RGB frames -> class {SCORES_KIND} ({len(class_names)})"
        )
        write_metadata(
            model,
            {
                "task": CLASSIFICATION.name,
                "name": name,
                "version": version,
                "labels": json.dumps(list(class_names)),
                "frame_size": str(frame_size),
                "precision": "fp32",
                "scores": SCORES_KIND,
                "input": f"{INPUT_NAME}: uint8 [batch, {frame_size}, {frame_size}, 3] RGB NHWC",
                "input_zero_point": f"{INPUT_ZERO_POINT:g}",
                "input_scale": f"{INPUT_SCALE!r}",
                **(extra_metadata or {}),
            },
        )
        onnx.checker.check_model(model)
        final = Path(tmp) / "final.onnx"
        onnx.save(model, str(final))
        got_raw = _run(raw, probe)
        got = _run(final, probe)
        diff_torch = float(np.abs(got - expected).max())
        diff_raw = float(np.abs(got - got_raw).max())
        if diff_torch > tolerance or diff_raw > tolerance:
            raise ModelError(
                f"exported {name} does not match: max |diff| vs torch {diff_torch:.2e},"
                f" vs unoptimised graph {diff_raw:.2e} (tolerance {tolerance:.0e})"
            )
        with atomic_path(path) as out:
            out.write_bytes(final.read_bytes())
    return ExportReport(
        path=path,
        max_abs_diff_vs_torch=diff_torch,
        max_abs_diff_vs_unoptimized=diff_raw,
        nodes_unoptimized=nodes_raw,
        nodes_final=len(model.graph.node),
        ops_final=dict(Counter(n.op_type for n in model.graph.node)),
        size_bytes=path.stat().st_size,
    )
