"""A tiny student-like ONNX model for tests, benchmarks and first tries.

It keeps the student contract (input "frames" uint8 [batch, H, W, 3] NHWC RGB,
output "scores" float32 [batch, classes] probabilities, labels in metadata) while
being small enough to build in milliseconds with ``onnx.helper``: no torch export,
no dependence on the reference students being trained in ``distill/``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["MemoryPublisher", "make_tiny_detector", "make_tiny_student"]


def make_tiny_student(
    path: Path,
    *,
    size: int = 32,
    classes: int = 4,
    channels: int = 8,
    seed: int = 0,
    name: str = "tiny-student",
    version: str = "test-1",
    labels: list[str] | None = None,
) -> Path:
    """Write a seeded conv -> relu -> pool -> linear -> softmax model to ``path``."""
    rng = np.random.default_rng(seed)
    conv_w = rng.normal(0, 0.5, (channels, 3, 3, 3)).astype(np.float32)
    conv_b = rng.normal(0, 0.1, (channels,)).astype(np.float32)
    fc_w = rng.normal(0, 2.0, (channels, classes)).astype(np.float32)
    fc_b = rng.normal(0, 0.2, (classes,)).astype(np.float32)
    scale = np.array(1.0 / 255.0, dtype=np.float32)
    nodes = [
        helper.make_node("Cast", ["frames"], ["f32"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["f32", "scale"], ["norm"]),
        helper.make_node("Transpose", ["norm"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "conv_w", "conv_b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["scores"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("frames", TensorProto.UINT8, ["batch", size, size, 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", classes])],
        initializer=[
            numpy_helper.from_array(scale, "scale"),
            numpy_helper.from_array(conv_w, "conv_w"),
            numpy_helper.from_array(conv_b, "conv_b"),
            numpy_helper.from_array(fc_w, "fc_w"),
            numpy_helper.from_array(fc_b, "fc_b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime the project supports
    labels = labels or [f"class-{i}" for i in range(classes)]
    for key, value in (
        ("edgeloop.labels", json.dumps(labels)),
        ("edgeloop.name", name),
        ("edgeloop.version", version),
    ):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def make_tiny_detector(
    path: Path,
    *,
    size: int = 32,
    boxes: list[tuple[float, float, float, float, int]] | None = None,
    rows: int = 8,
    name: str = "tiny-detector",
    version: str = "test-1",
    labels: list[str] | None = None,
) -> Path:
    """Write a detector (``shared.tasks.detection``'s contract) whose answer is readable.

    It answers every frame with the same ``boxes`` (x1, y1, x2, y2 as fractions, class),
    each scored by the frame's mean brightness (0 black .. 1 white), so a test chooses
    how sure it is by the frame it sends. Output ``detections`` [batch, rows, 6].
    """
    boxes = [(0.1, 0.1, 0.4, 0.5, 1), (0.5, 0.2, 0.9, 0.7, 2)] if boxes is None else boxes
    if len(boxes) > rows:
        raise ValueError(f"{len(boxes)} boxes do not fit {rows} rows")
    base = np.zeros((1, rows, 6), np.float32)
    mask = np.zeros((1, rows, 6), np.float32)
    for i, (x1, y1, x2, y2, cls) in enumerate(boxes):
        base[0, i] = (x1, y1, x2, y2, 0.0, cls)
        mask[0, i, 4] = 1.0
    nodes = [
        helper.make_node("Cast", ["frames"], ["f32"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["f32"], ["mean"], axes=[1, 2, 3], keepdims=1),
        helper.make_node("Mul", ["mean", "scale"], ["score"]),  # [batch, 1, 1, 1]
        helper.make_node("Reshape", ["score", "score_shape"], ["score3"]),  # [batch, 1, 1]
        helper.make_node("Mul", ["score3", "mask"], ["scored"]),
        helper.make_node("Add", ["scored", "base"], ["detections"]),
    ]
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("frames", TensorProto.UINT8, ["batch", size, size, 3])],
        [helper.make_tensor_value_info("detections", TensorProto.FLOAT, ["batch", rows, 6])],
        initializer=[
            numpy_helper.from_array(np.array(1.0 / 255.0, np.float32), "scale"),
            numpy_helper.from_array(np.array([-1, 1, 1], np.int64), "score_shape"),
            numpy_helper.from_array(base, "base"),
            numpy_helper.from_array(mask, "mask"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    classes = max((b[4] for b in boxes), default=0) + 1
    labels = labels or [f"class-{i}" for i in range(max(classes, 3))]
    for key, value in (
        ("edgeloop.task", "detection"),
        ("edgeloop.labels", json.dumps(labels)),
        ("edgeloop.name", name),
        ("edgeloop.version", version),
    ):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


class MemoryPublisher:
    """An in-memory Publisher: records what the agent publishes; ``connected`` is settable.

    With ``auto_receipt`` it plays a cloud that stores every sample at once: each
    published sample is receipted straight back to the agent's handler.
    """

    def __init__(self, *, connected: bool = True, auto_receipt: bool = False) -> None:
        import threading

        self._lock = threading.Lock()
        self.messages: list[tuple[str, bytes, int, bool]] = []
        self.connected_flag = connected
        self.auto_receipt = auto_receipt
        self._on_message: Callable[[str, bytes], None] | None = None
        self._on_connect: Callable[[], None] | None = None
        self.receipt_topic: str | None = None

    @property
    def connected(self) -> bool:
        return self.connected_flag

    @property
    def backlog(self) -> int:
        return 0

    def set_handlers(
        self, *, on_message: Callable[[str, bytes], None], on_connect: Callable[[], None]
    ) -> None:
        self._on_message = on_message
        self._on_connect = on_connect

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        with self._lock:
            self.messages.append((topic, payload, qos, retain))
        if self.auto_receipt and topic.endswith("/samples") and self._on_message is not None:
            from datetime import UTC, datetime

            from shared.envelope import decode_envelope
            from shared.messages import Receipt, encode_message

            envelope = decode_envelope(payload)
            receipt = Receipt(sample_ids=[envelope.header.sample_id], stored_at=datetime.now(UTC))
            self._on_message(topic.rsplit("/", 1)[0] + "/receipts", encode_message(receipt))

    def deliver(self, topic: str, payload: bytes) -> None:
        """Play an incoming message (receipt, verdict) to the agent."""
        assert self._on_message is not None
        self._on_message(topic, payload)

    def connect(self) -> None:
        self.connected_flag = True
        if self._on_connect is not None:
            self._on_connect()

    def sent(self, suffix: str = "/samples") -> list[bytes]:
        with self._lock:
            return [m[1] for m in self.messages if m[0].endswith(suffix)]

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass
