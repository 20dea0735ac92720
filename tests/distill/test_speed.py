from __future__ import annotations

import numpy as np

from distill.cache import ReferenceModels
from distill.frames import FrameSet
from distill.models import load_checkpoint
from distill.speed import compare_latency, eager_runner, ort_runner


def test_compare_latency_side_by_side(
    quick_models: ReferenceModels, small_test_set: FrameSet
) -> None:
    net = load_checkpoint(quick_models.student_pt).net
    runners = {
        "int8": ort_runner(quick_models.student_int8_onnx, 1),
        "fp32": ort_runner(quick_models.student_onnx, 1),
        "eager": eager_runner(net),
    }
    timing = compare_latency(
        runners, small_test_set.frames[:4], threads=1, repeats=3, target_s=0.02
    )
    assert set(timing) == {"int8", "fp32", "eager"}
    for t in timing.values():
        assert len(t.repeats_s) == 3 and t.median_s > 0 and t.batch == 4
        assert t.median_s == float(np.median(t.repeats_s))
        assert t.to_dict()["frames_per_s"] > 0
