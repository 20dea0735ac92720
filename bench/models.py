"""Benchmark of the reference models: accuracy, drift, size and speed against the issue's goals.

``run()`` bootstraps (or reuses) the reference pair from the model cache, then
measures everything on this machine and returns a JSON-able dict:
``{"name", "quick", "figures", "goals", "tables"}`` where ``tables`` are markdown
strings (goals, models, speed, INT8 settings, drift accuracy).

Speed is measured side by side in one process: ONNX Runtime INT8, ONNX Runtime
FP32 and the same student in PyTorch eager (``torch.inference_mode``), each with the
same single intra-op thread (an edge core; and on a shared 2-core machine, one
thread per contender keeps the figures stable), interleaved, median of 7 repeats.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from distill.cache import ReferenceConfig, bootstrap_reference_models
from distill.drift import DRIFT_NAMES
from distill.evaluate import DEFAULT_SEVERITIES, OnnxClassifier, drift_table
from distill.models import load_checkpoint
from distill.scenario import render_split
from distill.speed import compare_latency, eager_runner, ort_runner

__all__ = ["run"]

GOALS = {
    "drift_drop_points": 15.0,
    "teacher_clean": 0.98,
    "teacher_drift": 0.93,
    "student_clean": 0.95,
    "int8_tolerance_points": 1.0,
    "int8_size_ratio": 0.3,
    "int8_vs_fp32": 1.3,
    "int8_vs_eager": 5.0,
}


def _cpu() -> dict[str, Any]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", ""):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "model": model,
        "logical_cpus": os.cpu_count(),
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "avx512_vnni": "avx512_vnni" in flags,
        "avx_vnni": "avx_vnni" in flags,
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
    }


def _goal(name: str, target: str, measured: str, met: bool) -> dict[str, Any]:
    return {"goal": name, "target": target, "measured": measured, "met": bool(met)}


def run(quick: bool = False, *, cache_dir: Path | None = None, threads: int = 1) -> dict[str, Any]:
    """Measure the reference models; ``quick`` uses the quick pair and lighter sweeps."""
    refs = bootstrap_reference_models(cache_dir, quick=quick)
    scenario = ReferenceConfig.reference(quick=quick).scenario
    test_set = render_split("test", scenario)
    t_m, s_m = refs.metrics["teacher"], refs.metrics["student"]

    # -- accuracy under drift ------------------------------------------------------
    severities = (0.5, 1.0) if quick else DEFAULT_SEVERITIES
    table = drift_table(
        {
            "teacher": OnnxClassifier(refs.teacher_onnx),
            "student FP32": OnnxClassifier(refs.student_onnx),
            "student INT8": OnnxClassifier(refs.student_int8_onnx),
        },
        test_set,
        drifts=DRIFT_NAMES,
        severities=severities,
        seed=0,
    )
    teacher_clean = table.clean["teacher"]
    student_clean = table.clean["student FP32"]
    int8_clean = table.clean["student INT8"]
    teacher_at_1 = {d: table.cells["teacher"][d][1.0] for d in DRIFT_NAMES}
    student_drop = {d: student_clean - table.cells["student FP32"][d][1.0] for d in DRIFT_NAMES}

    # -- speed ---------------------------------------------------------------------
    net = load_checkpoint(refs.student_pt).net
    speed: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for batch in (1, 8):
        frames = test_set.frames[rng.choice(len(test_set), batch, replace=False)]
        runners = {
            "int8": ort_runner(refs.student_int8_onnx, threads),
            "fp32": ort_runner(refs.student_onnx, threads),
            "eager": eager_runner(net),
        }
        timing = compare_latency(
            runners, frames, threads=threads, repeats=7, target_s=0.05 if quick else 0.25
        )
        speed[str(batch)] = {
            **{name: t.to_dict() for name, t in timing.items()},
            "int8_vs_fp32": timing["fp32"].median_s / timing["int8"].median_s,
            "int8_vs_eager": timing["eager"].median_s / timing["int8"].median_s,
        }

    # -- goals ---------------------------------------------------------------------
    g = GOALS
    goals = [
        _goal(
            "each drift at 1.0 costs the clean-trained student",
            f">= {g['drift_drop_points']:g} points",
            ", ".join(f"{d} {100 * v:.1f}" for d, v in student_drop.items()),
            all(100 * v >= g["drift_drop_points"] for v in student_drop.values()),
        ),
        _goal(
            "teacher top-1, clean test",
            f">= {100 * g['teacher_clean']:g}%",
            f"{100 * teacher_clean:.2f}%",
            teacher_clean >= g["teacher_clean"],
        ),
        _goal(
            "teacher top-1 under every drift at 1.0",
            f">= {100 * g['teacher_drift']:g}%",
            ", ".join(f"{d} {100 * v:.1f}%" for d, v in teacher_at_1.items()),
            all(v >= g["teacher_drift"] for v in teacher_at_1.values()),
        ),
        _goal(
            "student FP32 top-1, clean test",
            f">= {100 * g['student_clean']:g}%",
            f"{100 * student_clean:.2f}%",
            student_clean >= g["student_clean"],
        ),
        _goal(
            "student INT8 vs FP32 top-1",
            f"within {g['int8_tolerance_points']:g} point",
            f"{100 * int8_clean:.2f}% vs {100 * student_clean:.2f}%"
            f" ({100 * (int8_clean - student_clean):+.2f})",
            100 * (student_clean - int8_clean) <= g["int8_tolerance_points"],
        ),
        _goal(
            "INT8 file size vs FP32",
            f"<= {g['int8_size_ratio']:g}x",
            f"{s_m['int8_size_ratio']:.3f}x ({s_m['int8_bytes'] / 1024:.0f} KB"
            f" vs {s_m['onnx_bytes'] / 1024:.0f} KB)",
            s_m["int8_size_ratio"] <= g["int8_size_ratio"],
        ),
    ]
    for b in ("1", "8"):
        sp = speed[b]
        goals.append(
            _goal(
                f"INT8 throughput vs FP32 ONNX Runtime, batch {b}",
                f">= {g['int8_vs_fp32']:g}x",
                f"{sp['int8_vs_fp32']:.2f}x",
                sp["int8_vs_fp32"] >= g["int8_vs_fp32"],
            )
        )
        goals.append(
            _goal(
                f"INT8 throughput vs PyTorch eager, batch {b}",
                f">= {g['int8_vs_eager']:g}x",
                f"{sp['int8_vs_eager']:.2f}x",
                sp["int8_vs_eager"] >= g["int8_vs_eager"],
            )
        )
    goals.append(
        _goal(
            "teacher training wall time (2 threads)",
            "<= 600 s",
            f"{t_m['train']['train_wall_s']:.0f} s",
            t_m["train"]["train_wall_s"] <= 600,
        )
    )
    goals.append(
        _goal(
            "student training wall time (2 threads)",
            "<= 180 s",
            f"{s_m['train']['train_wall_s']:.0f} s",
            s_m["train"]["train_wall_s"] <= 180,
        )
    )

    # -- tables --------------------------------------------------------------------
    goal_md = "\n".join(
        ["| goal | target | measured | met |", "|---|---|---|---|"]
        + [
            f"| {x['goal']} | {x['target']} | {x['measured']} | {'yes' if x['met'] else '**no**'} |"
            for x in goals
        ]
    )
    models_md = "\n".join(
        [
            "| model | params | MACs/frame | FLOPs/frame | file | test top-1 | train wall |",
            "|---|---:|---:|---:|---:|---:|---:|",
            f"| teacher FP32 | {t_m['params']:,} | {t_m['macs_per_frame'] / 1e6:.2f} M"
            f" | {t_m['flops_per_frame'] / 1e6:.2f} M | {t_m['onnx_bytes'] / 1024:.0f} KB"
            f" | {100 * teacher_clean:.2f}% | {t_m['train']['train_wall_s']:.0f} s |",
            f"| student FP32 | {s_m['params']:,} | {s_m['macs_per_frame'] / 1e6:.2f} M"
            f" | {s_m['flops_per_frame'] / 1e6:.2f} M | {s_m['onnx_bytes'] / 1024:.0f} KB"
            f" | {100 * student_clean:.2f}% | {s_m['train']['train_wall_s']:.0f} s |",
            f"| student INT8 ({s_m['quantization']['settings']}) | {s_m['params']:,}"
            f" | {s_m['macs_per_frame'] / 1e6:.2f} M | {s_m['flops_per_frame'] / 1e6:.2f} M"
            f" | {s_m['int8_bytes'] / 1024:.0f} KB | {100 * int8_clean:.2f}% | - |",
        ]
    )
    speed_md = "\n".join(
        [
            f"| batch | ORT INT8 ms | ORT FP32 ms | eager ms | INT8 vs FP32 | INT8 vs eager |"
            f"  (threads={threads}, median of 7)",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        + [
            f"| {b} | {speed[b]['int8']['median_ms']:.3f} | {speed[b]['fp32']['median_ms']:.3f}"
            f" | {speed[b]['eager']['median_ms']:.3f} | {speed[b]['int8_vs_fp32']:.2f}x"
            f" | {speed[b]['int8_vs_eager']:.2f}x |"
            for b in ("1", "8")
        ]
    )
    tables = [goal_md, models_md, speed_md]
    selection = s_m.get("quant_selection")
    if selection:
        tables.append(selection["markdown"] + f"\n\n{selection['reason']}")
    tables.append(table.to_markdown())

    figures = {
        "machine": _cpu(),
        "threads": threads,
        "test_frames": len(test_set),
        "teacher": {
            "params": t_m["params"],
            "macs_per_frame": t_m["macs_per_frame"],
            "flops_per_frame": t_m["flops_per_frame"],
            "onnx_bytes": t_m["onnx_bytes"],
            "train_wall_s": t_m["train"]["train_wall_s"],
            "test_accuracy": teacher_clean,
            "accuracy_at_severity_1": teacher_at_1,
        },
        "student": {
            "params": s_m["params"],
            "macs_per_frame": s_m["macs_per_frame"],
            "flops_per_frame": s_m["flops_per_frame"],
            "onnx_bytes": s_m["onnx_bytes"],
            "int8_bytes": s_m["int8_bytes"],
            "int8_size_ratio": s_m["int8_size_ratio"],
            "train_wall_s": s_m["train"]["train_wall_s"],
            "test_accuracy_fp32": student_clean,
            "test_accuracy_int8": int8_clean,
            "drop_at_severity_1_points": {d: 100 * v for d, v in student_drop.items()},
            "int8_settings": s_m["quantization"]["settings"],
        },
        "quant_selection": selection and {k: v for k, v in selection.items() if k != "markdown"},
        "speed": speed,
        "drift_table": table.to_dict(),
        "export": {"teacher": t_m["export"], "student": s_m["export"]},
    }
    return {
        "name": "models",
        "quick": quick,
        "figures": figures,
        "goals": goals,
        "all_goals_met": all(x["met"] for x in goals),
        "tables": tables,
    }
