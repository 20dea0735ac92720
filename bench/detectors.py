"""Benchmark of the reference detectors: mAP, size and INT8 against FP32 speed.

``run()`` bootstraps (or reuses) the detector pair from the model cache, then reads
its test-split figures (pycocotools mAP@0.5 and mAP@0.5:0.95, computed when the pair
was built) and measures on this machine, side by side in one process: the student in
ONNX Runtime INT8 and FP32 and the teacher in FP32, each with one intra-op thread,
interleaved, median of 7 repeats, at batch 1 and 8 (``distill.speed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.models import _cpu
from distill.detector_cache import DetectorReferenceConfig, bootstrap_reference_detectors
from distill.scenes import render_scenes
from distill.speed import compare_latency, ort_runner

__all__ = ["run"]

GOALS = {"int8_map50_drop_points": 1.5, "int8_speedup": 1.5}
BATCHES = (1, 8)


def run(quick: bool = False, *, cache_dir: Path | None = None, threads: int = 1) -> dict[str, Any]:
    refs = bootstrap_reference_detectors(cache_dir, quick=quick)
    student, teacher = refs.metrics["student"], refs.metrics["teacher"]
    frames = render_scenes("test", DetectorReferenceConfig.reference(quick=quick).scenario).frames
    speed: dict[str, dict[str, float]] = {}
    for batch in BATCHES:
        runners = {
            "student_int8": ort_runner(refs.student_int8_onnx, threads),
            "student_fp32": ort_runner(refs.student_onnx, threads),
            "teacher_fp32": ort_runner(refs.teacher_onnx, threads),
        }
        timings = compare_latency(runners, frames[:batch], threads=threads)
        speed[str(batch)] = {name: round(t.median_s * 1e3, 3) for name, t in timings.items()}
    int8_drop = 100 * (student["test"]["map50"] - student["int8_test"]["map50"])
    speedup = speed["8"]["student_fp32"] / speed["8"]["student_int8"]
    figures = {
        "frame_size": refs.frame_size,
        "student_params": student["params"],
        "student_macs_per_frame": student["macs_per_frame"],
        "teacher_params": teacher["params"],
        "teacher_macs_per_frame": teacher["macs_per_frame"],
        "teacher_map50": teacher["test"]["map50"],
        "teacher_map50_95": teacher["test"]["map50_95"],
        "student_fp32_map50": student["test"]["map50"],
        "student_fp32_map50_95": student["test"]["map50_95"],
        "student_int8_map50": student["int8_test"]["map50"],
        "student_int8_map50_95": student["int8_test"]["map50_95"],
        "int8_map50_drop_points": round(int8_drop, 2),
        "latency_ms": speed,
        "int8_speedup_batch8": round(speedup, 2),
        "threads": threads,
        "cpu": _cpu(),
    }
    goals = [
        {
            "goal": "detector INT8 mAP@0.5 drop (points)",
            "target": f"<= {GOALS['int8_map50_drop_points']}",
            "measured": round(int8_drop, 2),
            "status": "met" if int8_drop <= GOALS["int8_map50_drop_points"] else "not met",
        },
        {
            "goal": "detector INT8 / FP32 speed, batch 8, one thread",
            "target": f">= {GOALS['int8_speedup']}",
            "measured": round(speedup, 2),
            "status": "met" if speedup >= GOALS["int8_speedup"] else "not met",
        },
    ]
    rows = [
        "| model | params | MACs/frame | mAP@0.5 | mAP@0.5:0.95 | ms, batch 1 | ms, batch 8 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, params, macs, m50, m5095 in (
        ("teacher FP32", teacher["params"], teacher["macs_per_frame"], *_maps(teacher["test"])),
        ("student FP32", student["params"], student["macs_per_frame"], *_maps(student["test"])),
        (
            "student INT8",
            student["params"],
            student["macs_per_frame"],
            *_maps(student["int8_test"]),
        ),
    ):
        key = name.replace(" ", "_").lower()
        rows.append(
            f"| {name} | {params:,} | {macs / 1e6:.0f} M | {m50:.3f} | {m5095:.3f}"
            f" | {speed['1'][key]:.1f} | {speed['8'][key]:.1f} |"
        )
    return {
        "name": "detectors",
        "quick": quick,
        "figures": figures,
        "goals": goals,
        "tables": ["\n".join(rows)],
    }


def _maps(test: dict[str, Any]) -> tuple[float, float]:
    return float(test["map50"]), float(test["map50_95"])
