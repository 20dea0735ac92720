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
from shared.tasks import task_for
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


def inspect_onnx(data: bytes) -> dict[str, Any]:
    """Name, version, task, input spec, output, labels, opset and source of an ONNX student.

    Refuses (ManifestError, with the agent's reason slug) a model no agent would load:
    the student contract is one input ``frames`` uint8 [batch, H, W, 3] with a fixed H and
    W, and an output ``scores`` [batch, classes].
    """
    import onnx

    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise _refused(f"the artifact is not an ONNX model: {exc}", "not_onnx") from exc
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    outputs = {o.name: o for o in graph.output}
    names = [i.name for i in inputs]
    if len(inputs) != 1 or names[0] != "frames" or "scores" not in outputs:
        raise _refused(
            f"the model's tensors are {names} -> {sorted(outputs)}; the student contract is"
            " 'frames' -> 'scores'" + _WRAP_HINT,
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
    out_dims = outputs["scores"].type.tensor_type.shape.dim
    meta = {p.key: p.value for p in model.metadata_props}
    labels = _labels_from(meta)
    if labels is None:
        if len(out_dims) == 2 and out_dims[1].HasField("dim_value"):
            labels = [str(i) for i in range(out_dims[1].dim_value)]
        else:
            raise _refused(
                "the model names no labels (edgeloop.labels) and has no fixed classes", "labels"
            )
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < 1:
        raise _refused("the model imports no ai.onnx opset", "incompatible_opset")
    source = None
    if "edgeloop.source" in meta:
        try:
            source = ModelSource.model_validate_json(meta["edgeloop.source"])
        except ValueError as exc:  # pydantic: an older or foreign description
            log.warning("ignoring the model's edgeloop.source: %s", exc)
    task = meta.get("edgeloop.task")
    try:
        task_for(task)
    except ValueError as exc:
        raise _refused(f"the model's edgeloop.task: {exc}", "unsupported_task") from exc
    return {
        "task": task,
        "name": meta.get("edgeloop.name"),
        "version": meta.get("edgeloop.version"),
        "input": InputSpec(name="frames", shape=shape, dtype="uint8", layout="NHWC"),
        "output_name": "scores",
        "labels": labels,
        "opset": int(opset),
        "source": source,
    }


def _golden(
    data: bytes, spec: InputSpec, output_name: str, atol: float, labels: Sequence[str]
) -> list[GoldenCase]:
    """Deterministic frames and the scores this model gives them (ONNX Runtime, CPU).

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
        scores = session.run([output_name], {spec.name: frames.astype(spec.dtype)})[0]
    except Exception as exc:  # ORT's untyped errors, wrapped once
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _refused(
            f"onnxruntime {ort.__version__} cannot load or run the model: {first}", "load_failed"
        ) from exc
    scores = np.asarray(scores, dtype=np.float32)
    if scores.ndim != 2 or scores.shape[0] != count:
        raise _refused(
            f"'scores' has shape {list(scores.shape)} for {count} frames; it must be"
            " [batch, classes]",
            "incompatible_output",
        )
    if scores.shape[1] != len(labels):
        raise _refused(
            f"the model names {len(labels)} labels but 'scores' has {scores.shape[1]} classes",
            "labels",
        )
    import base64

    return [
        GoldenCase(
            input=base64.b64encode(frames.tobytes()).decode("ascii"),
            shape=[count, *dims[1:]],
            expected=[[float(x) for x in row] for row in scores],
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
            golden=_golden(data, info["input"], info["output_name"], atol, info["labels"]),
            created_at=now or datetime.now(UTC),
            parent_version=parent_version,
            metrics=metrics or {},
            source=info["source"],
            task=info["task"],
        )
    except ValueError as exc:  # pydantic: a manifest field out of its range
        raise ManifestError(f"cannot describe model {name} {version}: {exc}") from exc
