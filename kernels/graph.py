"""Split a teacher's in-graph pre- and post-processing off, for the GPU kernels to do.

The teacher contract puts preprocessing inside the ONNX graph (uint8 NHWC frames in,
probabilities out), so every runtime gets it right without help. On CUDA the
verifier can run that work as Triton kernels instead (``kernels.preprocess`` before
the network, ``kernels.scoring`` after it); ``split_teacher`` derives the model they
wrap:

* the *prefix*: from the uint8 input, a chain of Cast, per-channel Mul/Div/Add/Sub
  by constants and the Transpose to NCHW. It must be a per-channel affine map
  ``a[c] * x + b[c]`` (checked numerically on probe frames), which the
  preprocessing kernel computes as ``(x / 255 - mean[c]) / std[c]``;
* the *tail*: a final Softmax over the class axis, which the scoring kernel
  computes together with confidence, margin and entropy.

The variant takes float32 NCHW pixels and returns logits when the tail was split
off (probabilities otherwise). A graph of another shape yields no plan, and the
verifier keeps the in-graph path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

__all__ = ["TeacherSplit", "split_teacher"]

log = logging.getLogger(__name__)

_AFFINE_OPS = frozenset({"Mul", "Div", "Add", "Sub"})
_NCHW = [0, 3, 1, 2]
_MAX_PREFIX = 12


@dataclass(frozen=True)
class TeacherSplit:
    """The teacher without its in-graph preprocessing (and softmax, when it had one)."""

    model: bytes  # the variant, serialized ONNX
    input_name: str  # float32 [N, 3, H, W]
    output_name: str  # float32 [N, C]: logits if ``logits`` else probabilities
    logits: bool  # the final Softmax was split off: apply it after the network
    mean: tuple[float, float, float]  # per channel, in [0, 1] units of the uint8 input
    std: tuple[float, float, float]


def split_teacher(path: Path, output_name: str | None = None) -> TeacherSplit | None:
    """The split of the teacher at ``path``, or None when its graph does not fit (logged)."""
    model = onnx.load(str(path))
    graph = model.graph
    if len(graph.input) != 1:
        _no("the teacher has more than one input")
        return None
    source = graph.input[0]
    if source.type.tensor_type.elem_type != TensorProto.UINT8:
        _no("the teacher input is not uint8")
        return None
    constants = {init.name for init in graph.initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    chain = _prefix(graph, source.name, constants)
    if chain is None:
        return None
    # The longest part of the chain that is a per-channel affine map to float32 NCHW.
    last_transpose = max(i for i, n in enumerate(chain) if n.op_type == "Transpose")
    found = None
    for end in range(len(chain), last_transpose, -1):
        found = _affine(model, chain[:end], chain[end - 1].output[0])
        if found is not None:
            break
    if found is None:
        _no("no part of the input chain is a per-channel affine map to float32 NCHW")
        return None
    prefix = chain[:end]
    cut = prefix[-1].output[0]
    scale, offset = found
    # The kernel computes (x / 255 - mean) / std = x * a + b with a = 1 / (255 std) and
    # b = -mean / std: so std = 1 / (255 a) and mean = -b std.
    std = tuple(float(1.0 / (255.0 * a)) for a in scale)
    mean = tuple(float(-b * s) + 0.0 for b, s in zip(offset, std, strict=True))

    outputs = [o.name for o in graph.output]
    wanted = output_name or ("scores" if "scores" in outputs else outputs[0])
    producer = next((n for n in graph.node if wanted in n.output), None)
    logits = producer is not None and _is_class_softmax(producer, graph)

    dims = source.type.tensor_type.shape.dim
    batch = _dim(dims[0], "batch")
    height, width = _dim(dims[1], "height"), _dim(dims[2], "width")
    removed = {id(node) for node in prefix}
    nodes = [n for n in graph.node if id(n) not in removed]
    out_name = wanted
    if logits and producer is not None:
        out_name = producer.input[0]
        nodes = [n for n in nodes if n is not producer]
    used = {name for n in nodes for name in n.input}
    variant = helper.make_graph(
        nodes,
        graph.name,
        [helper.make_tensor_value_info(cut, TensorProto.FLOAT, [batch, 3, height, width])],
        [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, [batch, None])],
        [init for init in graph.initializer if init.name in used],
    )
    result = helper.make_model(variant, opset_imports=model.opset_import)
    result.ir_version = model.ir_version
    return TeacherSplit(
        model=result.SerializeToString(),
        input_name=cut,
        output_name=out_name,
        logits=logits,
        mean=(mean[0], mean[1], mean[2]),
        std=(std[0], std[1], std[2]),
    )


def _no(why: str) -> None:
    log.info("teacher keeps in-graph preprocessing: %s", why)


def _dim(dim: onnx.TensorShapeProto.Dimension, default: str) -> int | str:
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    return dim.dim_param or default


def _prefix(
    graph: onnx.GraphProto, source: str, constants: set[str]
) -> list[onnx.NodeProto] | None:
    """The longest plain chain from the input of Cast, affine ops by constants and one
    Transpose to NCHW (in any order), each node the only consumer of the one before."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    chain: list[onnx.NodeProto] = []
    current = source
    while len(chain) < _MAX_PREFIX:
        users = consumers.get(current, [])
        if len(users) != 1 or current in outputs:
            break
        node = users[0]
        if node.op_type in _AFFINE_OPS:
            others = [name for name in node.input if name != current]
            if len(others) != 1 or others[0] not in constants:
                break
        elif node.op_type == "Transpose":
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            if perm != _NCHW or any(n.op_type == "Transpose" for n in chain):
                break
        elif node.op_type != "Cast":
            break
        chain.append(node)
        current = node.output[0]
    if not any(n.op_type == "Transpose" for n in chain):
        _no("no NHWC -> NCHW transpose in a plain chain from the input")
        return None
    return chain


def _affine(
    model: onnx.ModelProto, prefix: list[onnx.NodeProto], cut: str
) -> tuple[list[float], list[float]] | None:
    """Per-channel (a, b) with prefix(x) == a * x + b, checked on probe frames."""
    import onnxruntime as ort

    graph = model.graph
    needed = {name for node in prefix for name in node.input}
    constant_nodes = [n for n in graph.node if n.op_type == "Constant" and n.output[0] in needed]
    source = graph.input[0]
    probe = helper.make_graph(
        [*constant_nodes, *prefix],
        "prefix",
        [helper.make_tensor_value_info(source.name, TensorProto.UINT8, [None, None, None, 3])],
        [helper.make_tensor_value_info(cut, TensorProto.FLOAT, None)],
        [init for init in graph.initializer if init.name in needed],
    )
    probe_model = helper.make_model(probe, opset_imports=model.opset_import)
    probe_model.ir_version = model.ir_version
    try:
        session = ort.InferenceSession(
            probe_model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        rng = np.random.default_rng(0)
        frames = rng.integers(0, 256, (2, 4, 5, 3), dtype=np.uint8)
        frames[0, 0, 0] = 0
        frames[0, 0, 1] = 255
        (got,) = session.run(None, {source.name: frames})
    except Exception as exc:  # onnxruntime's errors are untyped; any failure means no plan
        log.debug("the preprocessing chain does not run on its own: %s", exc)
        return None
    got = np.asarray(got)
    if got.dtype != np.float32 or got.shape != (2, 3, 4, 5):
        return None  # not (yet) float32 NCHW
    x = frames.transpose(0, 3, 1, 2).astype(np.float64)
    scale, offset = [], []
    for c in range(3):
        b = float(got[0, c, 0, 0])
        a = (float(got[0, c, 0, 1]) - b) / 255.0
        if a <= 0.0 or not np.allclose(got[:, c], a * x[:, c] + b, rtol=1e-5, atol=1e-5):
            return None  # not an increasing per-channel affine map
        scale.append(a)
        offset.append(b)
    return scale, offset


def _is_class_softmax(node: onnx.NodeProto, graph: onnx.GraphProto) -> bool:
    """A Softmax over the class axis of the [N, C] output (the teacher's probabilities)."""
    if node.op_type != "Softmax":
        return False
    declared = next((o for o in graph.output if o.name == node.output[0]), None)
    if declared is None or len(declared.type.tensor_type.shape.dim) != 2:
        return False
    axis = next((a.i for a in node.attribute if a.name == "axis"), None)
    # On a rank-2 tensor the default axis is the class axis in every opset.
    return axis in (None, 1, -1)
