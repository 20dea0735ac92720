"""Reading an ONNX student: its contract, labels and opset, golden cases, and its manifest.

A model no agent would load is refused here (ManifestError with the agent's reason slug),
before it is stored or announced.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np

from shared.errors import ContractError, ManifestError
from shared.manifest import GoldenCase, InputSpec, ModelManifest, ModelSource
from shared.tasks import CLASSIFICATION, Task, task_for
from shared.topics import validate_id

__all__ = ["build_manifest", "inspect_onnx", "min_runtime_for_opset", "stamp_identity"]

log = logging.getLogger(__name__)

# Lowest onnxruntime release that runs each ai.onnx opset (onnxruntime's compatibility
# table); anything newer than the table needs the runtime this cloud runs.
_OPSET_RUNTIME = {
    13: "1.7",
    14: "1.10",
    15: "1.11",
    16: "1.12",
    17: "1.13",
    18: "1.14",
    19: "1.16",
    20: "1.17",
    21: "1.18",
    22: "1.20",
    23: "1.22",
}
# Golden inputs travel base64 inside the retained announcement: keep them under ~48 KB.
_GOLDEN_BUDGET_BYTES = 36_000
_MAX_GOLDEN = 3


def min_runtime_for_opset(opset: int) -> str:
    """The lowest onnxruntime version that runs ``opset``."""
    if opset <= 13:
        return _OPSET_RUNTIME[13]
    if opset in _OPSET_RUNTIME:
        return _OPSET_RUNTIME[opset]
    import onnxruntime

    return ".".join(onnxruntime.__version__.split(".")[:2])


_WRAP_HINT = "; wrap a model of another contract with `edgeloop models import`"


def _refused(message: str, reason: str) -> ManifestError:
    return ManifestError(message, reason=reason)


def _labels_from(meta: dict[str, str]) -> list[str] | None:
    if "edgeloop.labels" not in meta:
        return None
    try:
        parsed = json.loads(meta["edgeloop.labels"])
    except ValueError as exc:
        raise _refused(f"the model's edgeloop.labels is not JSON: {exc}", "labels") from None
    if not isinstance(parsed, list) or not all(isinstance(x, str | int) for x in parsed):
        raise _refused("the model's edgeloop.labels must be a JSON list of class names", "labels")
    return [str(x) for x in parsed]


def _task(meta: dict[str, str]) -> Task:
    try:
        return task_for(meta.get("edgeloop.task"))
    except ValueError as exc:
        raise _refused(f"the model's edgeloop.task: {exc}", "unsupported_task") from exc


def inspect_onnx(data: bytes) -> dict[str, Any]:
    """Name, version, task, input spec, output, labels, opset and source of an ONNX student.

    Refuses (ManifestError, with the agent's reason slug) a model no agent would load:
    the student contract is one input ``frames`` uint8 [batch, H, W, 3] with a fixed H and
    W, and the output its task names (``edgeloop.task``): ``scores`` [batch, classes]
    for classification, ``detections`` [batch, K, 6] for detection, whose labels must be
    named (``edgeloop.labels``).
    """
    import onnx

    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise _refused(f"the artifact is not an ONNX model: {exc}", "not_onnx") from exc
    meta = {p.key: p.value for p in model.metadata_props}
    task = _task(meta)
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    outputs = {o.name: o for o in graph.output}
    names = [i.name for i in inputs]
    if len(inputs) != 1 or names[0] != "frames" or task.output_name not in outputs:
        raise _refused(
            f"the model's tensors are {names} -> {sorted(outputs)}; the {task.name} student"
            f" contract is 'frames' -> {task.output_name!r}" + _WRAP_HINT,
            "incompatible_input",
        )
    tensor = inputs[0].type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name if tensor.elem_type else "?"
    shape: list[int | str] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            shape.append(int(dim.dim_value))
        else:
            shape.append(dim.dim_param or "batch")
    fixed_hw = len(shape) == 4 and isinstance(shape[1], int) and isinstance(shape[2], int)
    if dtype != "uint8" or not fixed_hw or shape[3] != 3:
        raise _refused(
            f"input 'frames' is {dtype} {shape}; agents feed uint8 NHWC [batch, H, W, 3] with"
            " a fixed H and W" + _WRAP_HINT,
            "incompatible_input",
        )
    out_dims = outputs[task.output_name].type.tensor_type.shape.dim
    labels = _labels_from(meta)
    if labels is None:
        fixed = len(out_dims) == 2 and out_dims[1].HasField("dim_value")
        if task is not CLASSIFICATION or not fixed:
            raise _refused(
                "the model names no labels (edgeloop.labels) and has no fixed classes", "labels"
            )
        labels = [str(i) for i in range(out_dims[1].dim_value)]
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < 1:
        raise _refused("the model imports no ai.onnx opset", "incompatible_opset")
    source = None
    if "edgeloop.source" in meta:
        try:
            source = ModelSource.model_validate_json(meta["edgeloop.source"])
        except ValueError as exc:  # pydantic: an older or foreign description
            log.warning("ignoring the model's edgeloop.source: %s", exc)
    return {
        "task": meta.get("edgeloop.task"),
        "name": meta.get("edgeloop.name"),
        "version": meta.get("edgeloop.version"),
        "input": InputSpec(name="frames", shape=shape, dtype="uint8", layout="NHWC"),
        "output_name": task.output_name,
        "labels": labels,
        "opset": int(opset),
        "source": source,
    }


def _golden(
    data: bytes, spec: InputSpec, task: Task, atol: float, labels: Sequence[str]
) -> list[GoldenCase]:
    """Deterministic frames and what this model answers for them (ONNX Runtime, CPU).

    This is also the check that this cloud's runtime loads and runs the model: a
    model it cannot run is refused here, before any agent is told about it.
    """
    import onnxruntime as ort

    dims = [d if isinstance(d, int) else 1 for d in spec.shape]
    frame_bytes = int(np.prod(dims[1:]))
    count = max(1, min(_MAX_GOLDEN, _GOLDEN_BUDGET_BYTES // max(1, frame_bytes)))
    rng = np.random.default_rng(20261201)
    frames = rng.integers(0, 256, size=(count, *dims[1:]), dtype=np.uint8)
    try:
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        outputs = session.run([task.output_name], {spec.name: frames.astype(spec.dtype)})[0]
    except Exception as exc:  # ORT's untyped errors, wrapped once
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _refused(
            f"onnxruntime {ort.__version__} cannot load or run the model: {first}", "load_failed"
        ) from exc
    outputs = np.asarray(outputs, dtype=np.float32)
    try:
        if outputs.shape[:1] != (count,):
            raise ValueError(f"{outputs.shape[:1]} answers")
        rows = task.golden_rows(outputs)
    except ValueError as exc:
        raise _refused(
            f"{task.output_name!r} has shape {list(outputs.shape)} for {count} frames: {exc}",
            "incompatible_output",
        ) from None
    try:
        task.check_golden_width(len(rows[0]), len(labels))
    except ValueError as exc:
        raise _refused(
            f"{task.output_name!r} does not fit the model's labels: {exc}",
            "labels",
        ) from None
    import base64

    return [
        GoldenCase(
            input=base64.b64encode(frames.tobytes()).decode("ascii"),
            shape=[count, *dims[1:]],
            expected=rows,
            atol=atol,
        )
    ]


def stamp_identity(data: bytes, name: str | None, version: str | None) -> bytes:
    """The artifact with ``edgeloop.name`` / ``edgeloop.version`` set to the registry's.

    The agent tags every sample with the version its model file names, and the
    verifier its verdicts: a version registered under another name than the file's
    metadata is rewritten so that the file, the manifest and the samples agree.
    """
    import onnx

    wanted = {k: v for k, v in (("edgeloop.name", name), ("edgeloop.version", version)) if v}
    if not wanted:
        return data
    model = onnx.load_model_from_string(data)
    meta = {p.key: p.value for p in model.metadata_props}
    if all(meta.get(k) == v for k, v in wanted.items()):
        return data
    kept = [p for p in model.metadata_props if p.key not in wanted]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in wanted.items():
        model.metadata_props.add(key=key, value=value)
    return bytes(model.SerializeToString())


def build_manifest(
    data: bytes,
    *,
    name: str | None = None,
    version: str | None = None,
    format: str = "fp32",
    metrics: dict[str, float] | None = None,
    parent_version: str | None = None,
    atol: float = 1e-3,
    url: str | None = None,
    now: datetime | None = None,
) -> ModelManifest:
    """The manifest of an ONNX student: hash, size, input spec, labels, opset, golden cases."""
    import hashlib

    info = inspect_onnx(data)
    name = validate_id(name or info["name"] or "", "model")
    version = version or info["version"]
    if not version:
        raise ContractError("no version given and the model has no edgeloop.version metadata")
    try:
        return ModelManifest(
            name=name,
            version=version,
            format=format,
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
            url=url or f"/v1/models/{name}/{version}/artifact",
            input=info["input"],
            output_name=info["output_name"],
            labels=info["labels"],
            opset=info["opset"],
            min_runtime_version=min_runtime_for_opset(info["opset"]),
            golden=_golden(data, info["input"], task_for(info["task"]), atol, info["labels"]),
            created_at=now or datetime.now(UTC),
            parent_version=parent_version,
            metrics=metrics or {},
            source=info["source"],
            task=info["task"],
        )
    except ValueError as exc:  # pydantic: a manifest field out of its range
        raise ManifestError(f"cannot describe model {name} {version}: {exc}") from exc
