"""Static INT8 quantization (QDQ, per-channel weights) with ONNX Runtime, and choosing how.

One model, one setting: ``quantize_onnx`` (``distill.quantize_static``: calibration,
the float preprocessing folded into the camera byte, metadata carried over).
Choosing the setting: ``select_settings`` (``distill.quantize_select``) quantizes
with every known setting and keeps the fastest within the accuracy tolerance of
FP32. The frames used for each purpose: ``quantization_frames``
(``distill.quantize_frames``).
"""

from __future__ import annotations

from distill.quantize_frames import QuantFrames, quantization_frames
from distill.quantize_select import QuantSelection, SettingsTrial, select_settings
from distill.quantize_static import (
    DEFAULT_SETTINGS,
    KNOWN_SETTINGS,
    FrameCalibrationReader,
    QuantResult,
    QuantSettings,
    quantize_onnx,
)

__all__ = [
    "DEFAULT_SETTINGS",
    "KNOWN_SETTINGS",
    "FrameCalibrationReader",
    "QuantFrames",
    "QuantResult",
    "QuantSelection",
    "QuantSettings",
    "SettingsTrial",
    "quantization_frames",
    "quantize_onnx",
    "select_settings",
]
