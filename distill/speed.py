"""Side-by-side latency measurement of ONNX Runtime sessions and PyTorch eager models.

Fair comparisons need the contenders measured in the same run, interleaved, with
the same thread count: on a shared machine the background load drifts over
seconds, so timing A then B would attribute the drift to the model. Each repeat
times every contender once (rotating the order), and the figure reported is the
median over repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from distill.export import INPUT_NAME
from distill.models import FramesModel, torch_threads

__all__ = [
    "Timing",
    "compare_latency",
    "eager_runner",
    "ort_runner",
    "ort_session",
]

Runner = Callable[[np.ndarray], object]


@dataclass(frozen=True)
class Timing:
    """Seconds per call (one batch): the median and every repeat's mean."""

    median_s: float
    repeats_s: tuple[float, ...]
    calls_per_repeat: int
    batch: int

    @property
    def frames_per_s(self) -> float:
        return self.batch / self.median_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "median_ms": round(self.median_s * 1e3, 4),
            "frames_per_s": round(self.frames_per_s, 1),
            "repeats_ms": [round(r * 1e3, 4) for r in self.repeats_s],
            "calls_per_repeat": self.calls_per_repeat,
            "batch": self.batch,
        }


def ort_session(path: Path, threads: int = 1) -> ort.InferenceSession:
    """A CPU session with a fixed intra-op thread count and no inter-op parallelism."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ort_runner(path: Path, threads: int = 1) -> Runner:
    sess = ort_session(path, threads)

    def run(frames: np.ndarray) -> object:
        return sess.run(None, {INPUT_NAME: frames})

    return run


def eager_runner(net: nn.Module) -> Runner:
    """The same deployable model (uint8 NHWC in, probabilities out) in PyTorch eager.

    Its thread count is torch's global one; ``compare_latency(threads=...)`` sets it.
    """
    model = FramesModel(net).eval()

    def run(frames: np.ndarray) -> object:
        with torch.inference_mode():
            return model(torch.from_numpy(frames))

    return run


def compare_latency(
    runners: Mapping[str, Runner],
    frames: np.ndarray,
    *,
    threads: int = 1,
    repeats: int = 7,
    target_s: float = 0.2,
    warmup: int = 5,
) -> dict[str, Timing]:
    """Median seconds per call of each runner on ``frames``, measured interleaved.

    ``threads`` is applied to torch for the whole measurement; build ORT runners
    with the same number so eager and ONNX Runtime get the same cores.
    """
    with torch_threads(threads):
        return _compare(runners, frames, repeats=repeats, target_s=target_s, warmup=warmup)


def _compare(
    runners: Mapping[str, Runner], frames: np.ndarray, *, repeats: int, target_s: float, warmup: int
) -> dict[str, Timing]:
    frames = np.ascontiguousarray(frames)
    if not frames.flags.writeable:
        frames = frames.copy()
    calls: dict[str, int] = {}
    for name, run in runners.items():
        for _ in range(warmup):
            run(frames)
        # Size each timed loop to ~target_s so timer resolution and one-off hiccups
        # stay small against the total.
        t0 = time.perf_counter()
        run(frames)
        once = max(time.perf_counter() - t0, 1e-6)
        calls[name] = max(3, min(5000, int(target_s / once)))
    samples: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            run, n = runners[name], calls[name]
            t0 = time.perf_counter()
            for _ in range(n):
                run(frames)
            samples[name].append((time.perf_counter() - t0) / n)
    return {
        name: Timing(
            median_s=statistics.median(samples[name]),
            repeats_s=tuple(samples[name]),
            calls_per_repeat=calls[name],
            batch=len(frames),
        )
        for name in runners
    }
