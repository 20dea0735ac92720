"""mAP@0.5 of the reference detector pair on the test scenes, clean and under each drift.

    .venv/bin/python scripts/detector_drifts.py [--out FILE] [--seed 12] [--threads 2]

Trains the pair on first use (``distill.detector_cache``, cached afterwards), scores the
FP32 teacher and the INT8 student on the scenario's test split at severities 0.5 and 1.0
of every drift, prints a table and writes the figures as JSON (default
``bench/results/simulations/detector-drifts.json``). A closed loop recovers the student
only as far as the teacher holds up under the drift; this says how far that is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distill.detector_cache import DetectorReferenceConfig, bootstrap_reference_detectors
from distill.detector_eval import OnnxDetector, evaluate_under_drift
from distill.drift import DRIFT_NAMES
from distill.scenes import render_scenes

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "simulations" / "detector-drifts.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench/results/simulations/detector-drifts.json"
    )
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    args = parser.parse_args()
    refs = bootstrap_reference_detectors(None, progress=True)
    test = render_scenes("test", DetectorReferenceConfig.reference().scenario)
    specs = ["", *(f"{name}:{severity}" for name in DRIFT_NAMES for severity in (0.5, 1.0))]
    out: dict[str, dict[str, float]] = {}
    for role, path in (("teacher", refs.teacher_onnx), ("student_int8", refs.student_int8_onnx)):
        scored = evaluate_under_drift(
            OnnxDetector(path, threads=args.threads), test, specs, seed=args.seed
        )
        out[role] = {spec or "clean": round(m.map50, 4) for spec, m in scored.items()}
    teacher, student = out["teacher"], out["student_int8"]
    for spec in teacher:
        print(f"{spec:16s} teacher {teacher[spec]:.3f}  student {student[spec]:.3f}")
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
