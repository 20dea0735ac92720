"""What the installed onnxruntime runs: its version and the highest ai.onnx opset."""

from __future__ import annotations

from shared.manifest import version_tuple

__all__ = ["max_supported_opset", "runtime_version"]

# Highest ai.onnx opset each onnxruntime release runs (its compatibility table);
# releases newer than the table run at least the last entry.
_RUNTIME_OPSET = [
    ((1, 13), 17),
    ((1, 14), 18),
    ((1, 16), 19),
    ((1, 17), 20),
    ((1, 18), 21),
    ((1, 20), 22),
    ((1, 22), 23),
]


def runtime_version() -> str:
    """The installed onnxruntime's version."""
    import onnxruntime

    return str(onnxruntime.__version__)


def max_supported_opset(version: str | None = None) -> int:
    """The highest ai.onnx opset the installed (or given) onnxruntime runs."""
    have = version_tuple(version or runtime_version())[:2]
    supported = 0
    for release, opset in _RUNTIME_OPSET:
        if have >= release:
            supported = opset
    return supported
