"""A small teacher-like ONNX model for tests, benchmarks and first trials.

Same I/O contract as the real teacher (``frames`` uint8 [N, H, W, 3] in,
``scores`` float32 [N, C] probabilities out, labels in ``edgeloop.labels``), with
seeded random weights. Its shape is like a real teacher's in the way that matters
for serving: a conv stem and large dense layers, so batch 1 is bound by reading
the weights and batching pays, as it does for the big models the verifier runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["build_demo_teacher"]


def build_demo_teacher(
    path: Path,
    *,
    size: int = 64,
    classes: int = 10,
    hidden: int = 1024,
    seed: int = 0,
    labels: list[str] | None = None,
) -> Path:
    """Write the model to ``path`` (``size`` divisible by 8) and return the path."""
    if size % 8:
        raise ValueError("size must be a multiple of 8")
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int, fan_in: int) -> TensorProto:
        values = rng.standard_normal(shape).astype(np.float32) * np.float32(np.sqrt(2.0 / fan_in))
        return numpy_helper.from_array(values, name)

    def bias(name: str, n: int) -> TensorProto:
        return numpy_helper.from_array(np.zeros(n, np.float32), name)

    flat = 32 * (size // 8) ** 2
    inits = [
        numpy_helper.from_array(np.array(1 / 255, np.float32), "scale"),
        weight("c1w", 16, 3, 3, 3, fan_in=27),
        bias("c1b", 16),
        weight("c2w", 32, 16, 3, 3, fan_in=144),
        bias("c2b", 32),
        weight("f1w", flat, hidden, fan_in=flat),
        bias("f1b", hidden),
        weight("f2w", hidden, hidden, fan_in=hidden),
        bias("f2b", hidden),
        weight("f3w", hidden, classes, fan_in=hidden),
        bias("f3b", classes),
    ]
    nodes = [
        helper.make_node("Cast", ["frames"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["f", "scale"], ["fs"]),
        helper.make_node("Transpose", ["fs"], ["x0"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["x0", "c1w", "c1b"], ["x1"], strides=[2, 2], pads=[1] * 4),
        helper.make_node("Relu", ["x1"], ["x1r"]),
        helper.make_node("Conv", ["x1r", "c2w", "c2b"], ["x2"], strides=[2, 2], pads=[1] * 4),
        helper.make_node("Relu", ["x2"], ["x2r"]),
        helper.make_node("AveragePool", ["x2r"], ["x3"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["x3"], ["x4"], axis=1),
        helper.make_node("MatMul", ["x4", "f1w"], ["h1"]),
        helper.make_node("Add", ["h1", "f1b"], ["h1b"]),
        helper.make_node("Relu", ["h1b"], ["h1r"]),
        helper.make_node("MatMul", ["h1r", "f2w"], ["h2"]),
        helper.make_node("Add", ["h2", "f2b"], ["h2b"]),
        helper.make_node("Relu", ["h2b"], ["h2r"]),
        helper.make_node("MatMul", ["h2r", "f3w"], ["lg"]),
        helper.make_node("Add", ["lg", "f3b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["scores"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "edgeloop-demo-teacher",
        [helper.make_tensor_value_info("frames", TensorProto.UINT8, ["batch", size, size, 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", classes])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    names = labels or [f"class-{i}" for i in range(classes)]
    helper.set_model_props(
        model, {"edgeloop.labels": json.dumps(names), "edgeloop.version": f"demo-{seed}"}
    )
    onnx.checker.check_model(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    onnx.save(model, str(tmp))
    tmp.replace(path)
    return path
