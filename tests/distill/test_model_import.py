"""Wrapping a pre-trained ONNX classifier: the wrapped contract, the model card, the layouts
and dtypes, and each refusal with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from distill.export import read_onnx_info
from distill.model_import import ImportSpec, import_onnx, read_labels
from kernels.graph import split_teacher
from shared.errors import DataError, ModelError
from shared.manifest import ModelCard

LABELS = ["red", "green", "blue"]
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def _classifier(
    path: Path,
    *,
    layout: str = "NCHW",
    dtype: int = TensorProto.FLOAT,
    shape: list[int | str] | None = None,
    classes: int = 3,
    softmax: bool = False,
    spatial_output: bool = False,
    opset: int = 17,
) -> Path:
    """A tiny classifier: [Transpose to NCHW] -> [Cast] -> Conv -> pool -> logits/probs."""
    rng = np.random.default_rng(5)
    nodes = []
    current = "input"
    if dtype == TensorProto.UINT8:
        nodes.append(helper.make_node("Cast", [current], ["as_float"], to=TensorProto.FLOAT))
        current = "as_float"
    if layout == "NHWC":
        nodes.append(helper.make_node("Transpose", [current], ["nchw"], perm=[0, 3, 1, 2]))
        current = "nchw"
    nodes += [
        helper.make_node("Conv", [current, "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["conv"], ["pool"]),
    ]
    out_shape: list[int | str] = [1, classes, 1, 1] if spatial_output else [1, classes]
    if not spatial_output:
        nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], axis=1))
        nodes.append(helper.make_node("Gemm", ["flat", "fc", "fcb"], ["logits"]))
        last = "logits"
    else:
        last = "pool"
    if softmax:
        nodes.append(helper.make_node("Softmax", [last], ["out"], axis=1))
    else:
        nodes.append(helper.make_node("Identity", [last], ["out"]))
    default = [1, 3, 8, 8] if layout == "NCHW" else [1, 8, 8, 3]
    channels = classes if spatial_output else 4
    inits = [
        numpy_helper.from_array(rng.normal(0, 1, (channels, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.zeros(channels, np.float32), "b"),
    ]
    if not spatial_output:
        inits += [
            numpy_helper.from_array(rng.normal(0, 1, (4, classes)).astype(np.float32), "fc"),
            numpy_helper.from_array(np.zeros(classes, np.float32), "fcb"),
        ]
    graph = helper.make_graph(
        nodes,
        "user",
        [helper.make_tensor_value_info("input", dtype, shape or default)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, out_shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _spec(**changes: object) -> ImportSpec:
    fields: dict[str, object] = {
        "role": "student",
        "labels": LABELS,
        "input_name": "input",
        "layout": "NCHW",
        "dtype": "float32",
        "mean": MEAN,
        "std": STD,
        "scale": 1 / 255,
    }
    fields.update(changes)
    return ImportSpec(**fields)  # type: ignore[arg-type]


def _frames(n: int = 3, size: int = 8) -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _run(path: Path, frames: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["scores"], {"frames": frames})[0])


def _original(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows = [session.run(["out"], {"input": x[i : i + 1]})[0] for i in range(len(x))]
    return np.concatenate(rows).reshape(len(x), -1)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_float32_nchw_is_wrapped_on_the_contract_with_metadata_and_card(tmp_path: Path) -> None:
    source = _classifier(tmp_path / "user.onnx")
    result = import_onnx(source, _spec(name="shapes", version="1.0"), out=tmp_path / "w.onnx")
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, inp.type, inp.shape) == ("frames", "tensor(uint8)", ["batch", 8, 8, 3])
    assert (out.name, out.shape) == ("scores", ["batch", 3])
    frames = _frames()
    x = ((frames / 255.0 - np.array(MEAN)) / np.array(STD)).astype(np.float32)
    want = _softmax(_original(source, np.ascontiguousarray(x.transpose(0, 3, 1, 2))))
    got = _run(result.path, frames)
    assert np.abs(got - want).max() <= 1e-4 and result.max_abs_diff <= 1e-4
    info = read_onnx_info(result.path)
    assert (info.name, info.version, info.labels) == ("shapes", "1.0", tuple(LABELS))
    assert info.frame_size == 8 and info.scores == "probabilities"
    card = ModelCard.model_validate_json(result.card_path.read_text())
    assert result.card_path == tmp_path / "w.card.json"
    assert card.source.input.mean == list(MEAN) and card.source.outputs == "logits"
    assert card.input.shape == ["batch", 8, 8, 3] and card.labels == LABELS
    assert json.loads(info.metadata["source"])["sha256"] == card.source.sha256


def test_the_verifier_gpu_path_can_split_the_wrapped_preprocessing(tmp_path: Path) -> None:
    source = _classifier(tmp_path / "user.onnx")
    result = import_onnx(source, _spec(role="teacher"), out=tmp_path / "t.onnx")
    split = split_teacher(result.path)
    assert split is not None and split.logits
    assert split.mean == pytest.approx(MEAN, abs=1e-6)
    assert split.std == pytest.approx(STD, abs=1e-6)


def test_uint8_nhwc_and_probability_and_spatial_outputs(tmp_path: Path) -> None:
    uint8 = _classifier(tmp_path / "u8.onnx", layout="NHWC", dtype=TensorProto.UINT8)
    result = import_onnx(
        uint8, _spec(layout="NHWC", dtype="uint8", mean=(0, 0, 0), std=(1, 1, 1), scale=1.0),
        out=tmp_path / "u8w.onnx",
    )  # fmt: skip
    frames = _frames()
    want = _softmax(_original(uint8, frames))
    assert np.abs(_run(result.path, frames) - want).max() <= 1e-4

    probs = _classifier(tmp_path / "p.onnx", softmax=True)
    wrapped = import_onnx(probs, _spec(), out=tmp_path / "pw.onnx")
    assert wrapped.card.source.outputs == "probabilities"  # found: a Softmax makes it
    ops = [n.op_type for n in onnx.load(str(wrapped.path)).graph.node]
    assert ops.count("Softmax") == 1

    spatial = _classifier(tmp_path / "s.onnx", spatial_output=True)
    flat = import_onnx(spatial, _spec(), out=tmp_path / "sw.onnx")
    assert _run(flat.path, frames).shape == (3, 3)


def test_dynamic_size_needs_size_and_takes_it(tmp_path: Path) -> None:
    source = _classifier(tmp_path / "dyn.onnx", shape=["n", 3, "h", "w"])
    with pytest.raises(ModelError, match="dynamic height or width: give --size") as caught:
        import_onnx(source, _spec(), out=tmp_path / "x.onnx")
    assert caught.value.reason == "input_size"
    result = import_onnx(source, _spec(size=(12, 16)), out=tmp_path / "x.onnx")
    frames = np.random.default_rng(2).integers(0, 256, (2, 12, 16, 3), dtype=np.uint8)
    assert _run(result.path, frames).shape == (2, 3)
    assert result.card.input.shape == ["batch", 12, 16, 3]


@pytest.mark.parametrize(
    ("change", "model", "reason", "words"),
    [
        ({"input_name": "pixels"}, {}, "input", "no input 'pixels'; its inputs are ['input']"),
        ({}, {"shape": [1, 3, 8]}, "input_rank", "rank 3"),
        ({"layout": "NHWC"}, {}, "input_channels", "is the layout right?"),
        ({"labels": ["a", "b"]}, {}, "labels", "name 2 classes but output 'out' has 3"),
        ({}, {"opset": 99}, "incompatible_opset", "needs opset 99"),
        ({"dtype": "uint8", "mean": (0, 0, 0), "std": (1, 1, 1), "scale": 1.0}, {},
         "input_dtype", "is float32; --dtype says uint8"),
        ({"size": (16, 16)}, {}, "input_size", "fixed height of 8; --size asks 16"),
        ({}, {"shape": [2, 3, 8, 8]}, "input_batch", "fixed batch of 2"),
    ],
)  # fmt: skip
def test_refusals_name_the_reason(
    tmp_path: Path, change: dict[str, object], model: dict[str, object], reason: str, words: str
) -> None:
    source = _classifier(tmp_path / "m.onnx", **model)  # type: ignore[arg-type]
    with pytest.raises(ModelError) as caught:
        import_onnx(source, _spec(**change), out=tmp_path / "out.onnx")
    assert caught.value.reason == reason
    assert words in caught.value.message
    assert not (tmp_path / "out.onnx").exists()


def test_bad_arguments_are_data_errors(tmp_path: Path) -> None:
    source = _classifier(tmp_path / "m.onnx")
    with pytest.raises(DataError, match="apply to float32 models only"):
        import_onnx(source, _spec(dtype="uint8"), out=tmp_path / "o.onnx")
    with pytest.raises(DataError, match="std values must be positive"):
        import_onnx(source, _spec(std=(1, 0, 1)), out=tmp_path / "o.onnx")
    (tmp_path / "one.txt").write_text("only\n")
    with pytest.raises(DataError, match="at least 2"):
        read_labels(tmp_path / "one.txt")
    (tmp_path / "labels.json").write_text('["x", "y"]')
    assert read_labels(tmp_path / "labels.json") == ["x", "y"]
