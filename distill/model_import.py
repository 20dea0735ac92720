"""Import a pre-trained ONNX classifier: wrap it onto the EdgeLoop model contract.

    spec = ImportSpec(role="teacher", labels=[...], input_name="input", layout="NCHW",
                      dtype="float32", size=(224, 224), mean=(0.485, 0.456, 0.406),
                      std=(0.229, 0.224, 0.225), scale=1 / 255)
    result = import_onnx(Path("resnet.onnx"), spec, out=Path("resnet-edgeloop.onnx"))

Every agent and the verifier feed a model the camera's bytes: ``frames`` uint8
``[batch, H, W, 3]`` RGB NHWC, and read ``scores`` float32 ``[batch, classes]``
probabilities (distill/export.py, the contract). The wrapped graph is

    frames -> Cast(float32) -> Mul(scale) -> Sub(mean) -> Div(std) -> Transpose(NCHW)
           -> the user's graph -> [Flatten] -> [Softmax] -> scores

(Transpose only for an NCHW model; no Cast or arithmetic for a uint8 model; Softmax
only when the model returns logits), so each runtime serves it as it is, and the
verifier's GPU path can split the per-channel affine prefix off for its kernel
(kernels/graph.py). The ``edgeloop.*`` metadata the agent, the verifier and the
registry read (labels, name, version, frame size, scores kind, the source and its
preprocessing) is written into the model, and a model card (``ModelCard``, JSON)
beside it.

What cannot work is refused before anything is written, with the reason: an input
name the model lacks, several inputs, a rank other than 4, three channels missing, a
dtype other than the one given, dynamic height or width without a size, labels that
do not match the output's classes, an opset this onnxruntime lacks, a batch axis the
graph fixes, or a wrapped graph whose outputs differ from the original's.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, compose, helper, numpy_helper

from distill._io import atomic_path, atomic_write_bytes
from distill.export import INPUT_NAME, OUTPUT_NAME, SCORES_KIND, write_metadata
from shared.errors import DataError, ModelError
from shared.manifest import InputSpec, ModelCard, ModelSource
from shared.onnx_support import max_supported_opset
from shared.tasks import CLASSIFICATION
from shared.topics import validate_id

__all__ = [
    "ImportResult",
    "ImportSpec",
    "card_path_for",
    "import_onnx",
    "read_labels",
]

Role = Literal["teacher", "student"]
Layout = Literal["NCHW", "NHWC"]
Dtype = Literal["float32", "uint8"]
OutputsKind = Literal["logits", "probabilities"]

_PIXELS = "edgeloop_pixels"  # the preprocessing's output, fed to the user's graph
_SOURCE_PREFIX = "source/"  # every name of the user's graph, so none collides with ours
_PARITY_ATOL = 1e-4
_NAME_RE = re.compile(r"[^a-z0-9_-]+")
_VERSION_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_ELEM = {"float32": TensorProto.FLOAT, "uint8": TensorProto.UINT8}


def _refuse(message: str, reason: str) -> ModelError:
    return ModelError(message, reason=reason)


@dataclass(frozen=True)
class ImportSpec:
    """How the user's model wants its input, and what to call the result.

    Preprocessing per channel, on RGB pixels 0..255: ``(pixel * scale - mean) / std``.
    ``size`` is (height, width); None takes the model's own fixed size.
    """

    role: Role
    labels: Sequence[str]
    input_name: str
    layout: Layout = "NCHW"
    dtype: Dtype = "float32"
    size: tuple[int, int] | None = None
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    scale: float = 1.0
    output_name: str | None = None  # None: the model's only output
    outputs: OutputsKind | None = None  # None: probabilities if a Softmax makes it, else logits
    name: str | None = None  # None: from the file name
    version: str | None = None  # None: from the hashes of the source and this spec


@dataclass(frozen=True)
class ImportResult:
    path: Path
    card_path: Path
    card: ModelCard
    max_abs_diff: float  # wrapped model on uint8 frames vs the original on numpy preprocessing

    def to_dict(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "card": str(self.card_path),
            "name": self.card.name,
            "version": self.card.version,
            "role": self.card.role,
            "input": self.card.input.model_dump(mode="json"),
            "labels": list(self.card.labels),
            "max_abs_diff": self.max_abs_diff,
        }


def read_labels(path: Path) -> list[str]:
    """Class names from a text file (one a line) or a JSON list; index = class id."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read the labels file {path}: {exc}") from exc
    if text.lstrip().startswith("["):
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise DataError(f"{path} starts like JSON but is not a JSON list: {exc}") from exc
        if not isinstance(parsed, list):
            raise DataError(f"{path} must hold a JSON list of class names")
        labels = [str(x).strip() for x in parsed]
    else:
        labels = [line.strip() for line in text.splitlines() if line.strip()]
    if len(labels) < 2:
        raise DataError(f"{path} names {len(labels)} classes; a classifier needs at least 2")
    if len(set(labels)) != len(labels):
        repeated = sorted({x for x in labels if labels.count(x) > 1})
        raise DataError(f"{path} names some classes twice: {repeated[:5]}")
    return labels


def card_path_for(path: Path) -> Path:
    """Where the model card of the model at ``path`` lives: ``NAME.card.json`` beside it."""
    return path.with_name(f"{path.stem}.card.json")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _dims(value: onnx.ValueInfoProto) -> list[int | None]:
    return [
        int(d.dim_value) if d.HasField("dim_value") else None
        for d in value.type.tensor_type.shape.dim
    ]


def _default_opset(model: onnx.ModelProto) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def _check_spec(spec: ImportSpec) -> None:
    if spec.role not in ("teacher", "student"):
        raise DataError(f"role must be teacher or student, not {spec.role!r}")
    if spec.layout not in ("NCHW", "NHWC"):
        raise DataError(f"layout must be NCHW or NHWC, not {spec.layout!r}")
    if spec.dtype not in _ELEM:
        raise DataError(f"dtype must be float32 or uint8, not {spec.dtype!r}")
    if len(spec.mean) != 3 or len(spec.std) != 3:
        raise DataError("mean and std take three values, one per RGB channel")
    if any(not np.isfinite(s) or s <= 0 for s in spec.std):
        raise DataError(f"std values must be positive, got {list(spec.std)}")
    if not np.isfinite(spec.scale) or spec.scale <= 0:
        raise DataError(f"scale must be positive, got {spec.scale}")
    if spec.size is not None and min(spec.size) < 1:
        raise DataError(f"size must be positive, got {spec.size}")
    identity = spec.scale == 1.0 and spec.mean == (0.0, 0.0, 0.0) and spec.std == (1.0, 1.0, 1.0)
    if not 2 <= len(spec.labels) <= 1000:
        raise DataError(f"a classifier needs 2 to 1000 labels, got {len(spec.labels)}")
    for label in spec.labels:
        if not 1 <= len(label) <= 128 or any(ord(ch) < 0x20 for ch in label):
            raise DataError(f"label {label[:40]!r} must be 1-128 characters, no control characters")
    if len(set(spec.labels)) != len(spec.labels):
        raise DataError("labels must be unique")
    if spec.name is not None:
        validate_id(spec.name, "model")
    if spec.version is not None and not _VERSION_RE.fullmatch(spec.version):
        raise DataError(
            f"version {spec.version!r} must be 1-64 characters of a-z, 0-9, '.', '_' and '-',"
            " starting with a letter or digit"
        )
    if spec.dtype == "uint8" and not identity:
        raise DataError(
            "a uint8 model takes the camera's bytes as they are: --mean, --std and --scale"
            " apply to float32 models only"
        )


def _load(path: Path) -> tuple[onnx.ModelProto, bytes]:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise _refuse(f"cannot read {path}: {exc.strerror}", "not_found") from exc
    try:
        model = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf's DecodeError and friends: wrap once here
        raise _refuse(f"{path} is not an ONNX model: {exc}", "not_onnx") from exc
    return model, data


def _input_shape(model: onnx.ModelProto, spec: ImportSpec) -> tuple[int, int]:
    """(height, width) of the user's input, checked against ``spec`` (batch 1 or dynamic)."""
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    names = [i.name for i in inputs]
    if spec.input_name not in names:
        raise _refuse(
            f"the model has no input {spec.input_name!r}; its inputs are {names}", "input"
        )
    if len(inputs) != 1:
        raise _refuse(
            f"the model takes {len(inputs)} inputs {names}; an imported classifier takes one",
            "input",
        )
    value = inputs[0]
    elem = value.type.tensor_type.elem_type
    if elem != _ELEM[spec.dtype]:
        actual = helper.tensor_dtype_to_np_dtype(elem).name if elem else "an unknown type"
        raise _refuse(
            f"input {spec.input_name!r} is {actual}; --dtype says {spec.dtype}", "input_dtype"
        )
    dims = _dims(value)
    shown = (
        "["
        + ", ".join(
            str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
            for d in value.type.tensor_type.shape.dim
        )
        + "]"
    )
    if len(dims) != 4:
        raise _refuse(
            f"input {spec.input_name!r} has rank {len(dims)} {shown}; an image classifier"
            f" takes rank 4 ({spec.layout})",
            "input_rank",
        )
    batch, *rest = dims
    h, w, c = (rest[1], rest[2], rest[0]) if spec.layout == "NCHW" else tuple(rest)
    if c is not None and c != 3:
        raise _refuse(
            f"input {spec.input_name!r} {shown} has {c} channels on the {spec.layout} channel"
            " axis; camera frames have 3 (is the layout right?)",
            "input_channels",
        )
    if spec.size is not None:
        for axis, got, want in (("height", h, spec.size[0]), ("width", w, spec.size[1])):
            if got is not None and got != want:
                raise _refuse(
                    f"input {spec.input_name!r} has a fixed {axis} of {got}; --size asks {want}",
                    "input_size",
                )
        h, w = spec.size
    if h is None or w is None:
        raise _refuse(
            f"input {spec.input_name!r} {shown} has a dynamic height or width: give --size WxH",
            "input_size",
        )
    if batch is not None and batch != 1:
        raise _refuse(
            f"input {spec.input_name!r} has a fixed batch of {batch}; the contract needs a"
            " dynamic batch axis",
            "input_batch",
        )
    return h, w


def _choose_output(model: onnx.ModelProto, spec: ImportSpec) -> onnx.ValueInfoProto:
    outputs = list(model.graph.output)
    names = [o.name for o in outputs]
    if spec.output_name is None:
        if len(outputs) != 1:
            raise _refuse(f"the model has outputs {names}: name the scores with --output", "output")
        return outputs[0]
    for output in outputs:
        if output.name == spec.output_name:
            return output
    raise _refuse(
        f"the model has no output {spec.output_name!r}; its outputs are {names}", "output"
    )


def _outputs_kind(model: onnx.ModelProto, output: str, spec: ImportSpec) -> OutputsKind:
    if spec.outputs is not None:
        return spec.outputs
    producer = next((n for n in model.graph.node if output in n.output), None)
    return "probabilities" if producer is not None and producer.op_type == "Softmax" else "logits"


def _free_batch(model: onnx.ModelProto, input_name: str, output_name: str) -> None:
    """Make the batch axis of the input and the output dynamic (they may say 1)."""
    for value in (*model.graph.input, *model.graph.output):
        if value.name in (input_name, output_name):
            dims = value.type.tensor_type.shape.dim
            if len(dims):
                dims[0].Clear()
                dims[0].dim_param = "batch"


def _preprocessing(
    model: onnx.ModelProto, spec: ImportSpec, hw: tuple[int, int]
) -> onnx.ModelProto:
    """frames uint8 [batch, H, W, 3] -> the user's input, as a model to compose in front."""
    h, w = hw
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    current = INPUT_NAME
    if spec.dtype == "float32":
        nodes.append(helper.make_node("Cast", [current], ["edgeloop_f32"], to=TensorProto.FLOAT))
        current = "edgeloop_f32"
        steps = (
            ("Mul", "edgeloop_scale", np.float32(spec.scale), spec.scale != 1.0),
            ("Sub", "edgeloop_mean", np.asarray(spec.mean, np.float32), any(spec.mean)),
            ("Div", "edgeloop_std", np.asarray(spec.std, np.float32), spec.std != (1.0, 1.0, 1.0)),
        )
        for op, const, value, needed in steps:
            if needed:
                inits.append(numpy_helper.from_array(np.asarray(value, np.float32), const))
                nodes.append(helper.make_node(op, [current, const], [f"{const}_out"]))
                current = f"{const}_out"
    if spec.layout == "NCHW":
        nodes.append(helper.make_node("Transpose", [current], [_PIXELS], perm=[0, 3, 1, 2]))
    else:
        nodes.append(helper.make_node("Identity", [current], [_PIXELS]))
    shape: list[str | int] = ["batch", 3, h, w] if spec.layout == "NCHW" else ["batch", h, w, 3]
    graph = helper.make_graph(
        nodes,
        "edgeloop_preprocessing",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ["batch", h, w, 3])],
        [helper.make_tensor_value_info(_PIXELS, _ELEM[spec.dtype], shape)],
        inits,
    )
    pre = helper.make_model(graph, opset_imports=list(model.opset_import))
    pre.ir_version = model.ir_version
    return pre


def _append_scoring(
    merged: onnx.ModelProto, output: str, rank: int, kind: OutputsKind, classes: int
) -> None:
    """Flatten a [batch, C, 1, 1] output, add the Softmax for logits, name the result scores."""
    graph = merged.graph
    current = output
    if rank != 2:
        graph.node.append(helper.make_node("Flatten", [current], ["edgeloop_flat"], axis=1))
        current = "edgeloop_flat"
    if kind == "logits":
        graph.node.append(helper.make_node("Softmax", [current], [OUTPUT_NAME], axis=1))
    else:
        graph.node.append(helper.make_node("Identity", [current], [OUTPUT_NAME]))
    del graph.output[:]
    graph.output.append(
        helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", classes])
    )


def _session(data: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _numpy_preprocess(frames: np.ndarray, spec: ImportSpec) -> np.ndarray:
    """What the wrapped graph computes in front of the user's model, in NumPy."""
    x: np.ndarray = frames
    if spec.dtype == "float32":
        x = frames.astype(np.float32) * np.float32(spec.scale)
        x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    if spec.layout == "NCHW":
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x)


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - x.max(axis=1, keepdims=True))
    return np.asarray(shifted / shifted.sum(axis=1, keepdims=True))


def _default_name(path: Path) -> str:
    name = _NAME_RE.sub("-", path.stem.lower()).strip("-_")[:64]
    return name or "imported"


def import_onnx(source: Path, spec: ImportSpec, *, out: Path) -> ImportResult:
    """Wrap the classifier at ``source`` onto the contract; write it to ``out`` with its card."""
    source = Path(source)
    _check_spec(spec)
    model, data = _load(source)
    opset = _default_opset(model)
    limit = max_supported_opset()
    if opset < 1:
        raise _refuse(f"{source} imports no ai.onnx opset", "opset")
    if opset > limit:
        raise _refuse(
            f"{source} needs opset {opset}; onnxruntime {ort.__version__} here runs up to"
            f" {limit}: export it again with a lower opset",
            "incompatible_opset",
        )
    h, w = _input_shape(model, spec)
    output = _choose_output(model, spec)
    labels = list(spec.labels)
    try:
        original = _session(data)
    except Exception as exc:  # onnxruntime's untyped errors, wrapped once
        raise _refuse(f"onnxruntime cannot load {source}: {exc}", "load_failed") from exc
    rng = np.random.default_rng(20261202)
    probe = rng.integers(0, 256, size=(2, h, w, 3), dtype=np.uint8)
    probe[0, 0, 0] = (0, 128, 255)
    one = _numpy_preprocess(probe[:1], spec)
    try:
        (first,) = original.run([output.name], {spec.input_name: one})
    except Exception as exc:
        raise _refuse(
            f"{source} does not run on a {list(one.shape)} {spec.dtype} input: {exc}",
            "input_size",
        ) from exc
    first = np.asarray(first)
    rank = first.ndim
    if rank < 2 or any(d != 1 for d in first.shape[2:]):
        raise _refuse(
            f"output {output.name!r} has shape {list(first.shape)}; a classifier returns"
            " [batch, classes] (or [batch, classes, 1, 1])",
            "output",
        )
    classes = int(first.shape[1])
    if classes != len(labels):
        raise _refuse(
            f"the labels name {len(labels)} classes but output {output.name!r} has {classes}",
            "labels",
        )
    kind = _outputs_kind(model, output.name, spec)

    # -- compose: preprocessing, the user's graph, scoring ------------------------------
    body = onnx.ModelProto()
    body.CopyFrom(model)
    del body.metadata_props[:]
    _free_batch(body, spec.input_name, output.name)
    try:
        merged = compose.merge_models(
            _preprocessing(model, spec, (h, w)),
            body,
            io_map=[(_PIXELS, spec.input_name)],
            outputs=[_SOURCE_PREFIX + output.name],
            prefix2=_SOURCE_PREFIX,
        )
    except Exception as exc:  # onnx.compose raises ValueError and checker errors
        raise _refuse(f"cannot compose the preprocessing with {source}: {exc}", "compose") from exc
    _append_scoring(merged, _SOURCE_PREFIX + output.name, rank, kind, classes)

    name = spec.name or _default_name(source)
    source_sha = _sha256(data)
    source_input = InputSpec(
        name=spec.input_name,
        shape=["batch", 3, h, w] if spec.layout == "NCHW" else ["batch", h, w, 3],
        dtype=spec.dtype,
        layout=spec.layout,
        mean=list(spec.mean),
        std=list(spec.std),
        scale=spec.scale,
    )
    origin = ModelSource(
        file=source.name[-128:],
        sha256=source_sha,
        input=source_input,
        output_name=output.name,
        outputs=kind,
    )
    version = (
        spec.version
        or _sha256((source_sha + origin.model_dump_json() + json.dumps(labels)).encode())[:12]
    )
    merged.producer_name = "edgeloop-import"
    merged.doc_string = (
        f"{name} {version}: uint8 NHWC RGB frames -> class {SCORES_KIND} ({classes}),"
        f" wrapping {source.name}"
    )
    write_metadata(
        merged,
        {
            "task": CLASSIFICATION.name,  # scores out, after the classification head
            "name": name,
            "version": version,
            "role": spec.role,
            "labels": json.dumps(labels),
            "precision": "fp32",
            "scores": SCORES_KIND,
            "input": f"{INPUT_NAME}: uint8 [batch, {h}, {w}, 3] RGB NHWC",
            "frame_hw": f"{h}x{w}",
            "source": origin.model_dump_json(),
            **({"frame_size": str(h)} if h == w else {}),
        },
    )
    try:
        onnx.checker.check_model(merged)
        wrapped = merged.SerializeToString()
        session = _session(wrapped)
        (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: probe})
    except Exception as exc:  # checker and onnxruntime errors: wrap once
        raise _refuse(f"the wrapped model does not check or run: {exc}", "load_failed") from exc

    # -- parity: the wrapped graph on bytes == the original on numpy preprocessing -----
    # The original runs one frame at a time: its own graph may fix the batch at 1.
    pixels = _numpy_preprocess(probe, spec)
    rows = [original.run([output.name], {spec.input_name: pixels[i : i + 1]})[0] for i in range(2)]
    want = np.concatenate([np.asarray(r) for r in rows])
    want = np.asarray(want, np.float32).reshape(len(probe), classes)
    if kind == "logits":
        want = _softmax(want)
    diff = float(np.abs(np.asarray(got, np.float32) - want).max())
    if not diff <= _PARITY_ATOL:
        raise _refuse(
            f"the wrapped model differs from {source} by {diff:.2e} (more than"
            f" {_PARITY_ATOL:g}) on the same frames",
            "parity",
        )

    with atomic_path(out) as tmp:
        tmp.write_bytes(wrapped)
    card = ModelCard(
        name=name,
        version=version,
        role=spec.role,
        sha256=_sha256(wrapped),
        input=InputSpec(name=INPUT_NAME, shape=["batch", h, w, 3], dtype="uint8", layout="NHWC"),
        output_name=OUTPUT_NAME,
        labels=labels,
        opset=opset,
        source=origin,
        created_at=datetime.now(UTC),
    )
    card_path = card_path_for(Path(out))
    atomic_write_bytes(card_path, (card.model_dump_json(indent=2) + "\n").encode())
    return ImportResult(path=Path(out), card_path=card_path, card=card, max_abs_diff=diff)
