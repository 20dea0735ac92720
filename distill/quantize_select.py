"""Choosing how to quantize: every known setting, measured side by side with FP32.

``select_settings`` quantizes with each known setting (activation/weight types
U8S8, S8S8, with and without ``reduce_range``), measures accuracy and latency side
by side, and keeps the fastest setting whose accuracy is within the tolerance of
FP32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from distill.frames import FrameSet
from distill.quantize_static import KNOWN_SETTINGS, QuantResult, QuantSettings, quantize_onnx

__all__ = ["QuantSelection", "SettingsTrial", "select_settings"]


@dataclass(frozen=True)
class SettingsTrial:
    settings: QuantSettings
    accuracy: float
    size_bytes: int
    folded_input: bool
    latency_ms: dict[int, float]  # batch -> median ms per batch
    speedup: dict[int, float]  # batch -> FP32 latency / this latency
    meets_accuracy: bool

    @property
    def score(self) -> float:
        """Geometric mean speed-up over the measured batch sizes."""
        vals = list(self.speedup.values())
        return float(np.exp(np.mean(np.log(vals)))) if vals else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings.label,
            "accuracy": self.accuracy,
            "size_bytes": self.size_bytes,
            "folded_input": self.folded_input,
            "latency_ms": {str(b): v for b, v in self.latency_ms.items()},
            "speedup_vs_fp32": {str(b): v for b, v in self.speedup.items()},
            "score": round(self.score, 3),
            "meets_accuracy": self.meets_accuracy,
        }


@dataclass(frozen=True)
class QuantSelection:
    chosen: QuantSettings
    fp32_accuracy: float
    fp32_latency_ms: dict[int, float]
    trials: tuple[SettingsTrial, ...]
    tolerance: float
    reason: str
    threads: int
    eval_frames: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.label,
            "reason": self.reason,
            "fp32_accuracy": self.fp32_accuracy,
            "fp32_latency_ms": {str(b): v for b, v in self.fp32_latency_ms.items()},
            "tolerance": self.tolerance,
            "threads": self.threads,
            "eval_frames": self.eval_frames,
            "trials": [t.to_dict() for t in self.trials],
        }

    def to_markdown(self) -> str:
        batches = sorted(self.fp32_latency_ms)
        head = (
            "| setting | top-1 % | size KB | "
            + " | ".join(f"ms b{b} | x FP32 b{b}" for b in batches)
            + " | within bound | chosen |"
        )
        rule = "|---|---:|---:|" + "---:|---:|" * len(batches) + "---|---|"
        fp32 = (
            f"| FP32 | {100 * self.fp32_accuracy:.2f} | - | "
            + " | ".join(f"{self.fp32_latency_ms[b]:.3f} | 1.00" for b in batches)
            + " | - | |"
        )
        rows = [head, rule, fp32]
        for t in self.trials:
            lat = " | ".join(f"{t.latency_ms[b]:.3f} | {t.speedup[b]:.2f}" for b in batches)
            ok = "yes" if t.meets_accuracy else "no"
            chosen = "**yes**" if t.settings == self.chosen else ""
            rows.append(
                f"| {t.settings.label} | {100 * t.accuracy:.2f} | {t.size_bytes / 1024:.0f}"
                f" | {lat} | {ok} | {chosen} |"
            )
        return "\n".join(rows)


def select_settings(
    fp32_path: Path,
    calibration: np.ndarray,
    eval_set: FrameSet,
    out_dir: Path,
    *,
    candidates: Sequence[QuantSettings] = KNOWN_SETTINGS,
    tolerance: float = 0.01,
    threads: int = 1,
    batches: Sequence[int] = (1, 8),
    repeats: int = 5,
    speed_noise: float = 0.03,
) -> tuple[QuantSelection, dict[QuantSettings, Path]]:
    """Quantize with every candidate; keep the fastest within ``tolerance`` of FP32 top-1.

    Accuracy is measured on ``eval_set`` (use a held-out split, not the calibration
    frames); latency side by side with FP32 at each batch size, ``threads`` intra-op
    threads, median of ``repeats``. Returns the selection and each candidate's file.
    """
    from distill.evaluate import OnnxClassifier, accuracy
    from distill.speed import compare_latency, ort_runner

    out_dir.mkdir(parents=True, exist_ok=True)
    fp32_acc = accuracy(OnnxClassifier(fp32_path), eval_set)
    paths: dict[QuantSettings, Path] = {}
    results: dict[QuantSettings, QuantResult] = {}
    accs: dict[QuantSettings, float] = {}
    for s in candidates:
        path = out_dir / f"int8-{s.label.replace('+', '-').lower()}.onnx"
        results[s] = quantize_onnx(fp32_path, path, calibration, s)
        paths[s] = path
        accs[s] = accuracy(OnnxClassifier(path), eval_set)

    rng = np.random.default_rng(0)
    fp32_lat: dict[int, float] = {}
    lat: dict[QuantSettings, dict[int, float]] = {s: {} for s in candidates}
    for b in batches:
        frames = eval_set.frames[rng.choice(len(eval_set), b, replace=len(eval_set) < b)]
        runners = {"fp32": ort_runner(fp32_path, threads)}
        runners.update({s.label: ort_runner(paths[s], threads) for s in candidates})
        timing = compare_latency(runners, frames, threads=threads, repeats=repeats)
        fp32_lat[b] = timing["fp32"].median_s * 1e3
        for s in candidates:
            lat[s][b] = timing[s.label].median_s * 1e3

    trials = tuple(
        SettingsTrial(
            settings=s,
            accuracy=accs[s],
            size_bytes=results[s].size_bytes,
            folded_input=results[s].folded_input,
            latency_ms={b: round(v, 4) for b, v in lat[s].items()},
            speedup={b: round(fp32_lat[b] / lat[s][b], 3) for b in batches},
            meets_accuracy=accs[s] >= fp32_acc - tolerance,
        )
        for s in candidates
    )
    eligible = [t for t in trials if t.meets_accuracy]
    if eligible:
        fastest = max(t.score for t in eligible)
        # Settings within timing noise of the fastest count as equally fast; among
        # those the most accurate wins (then the faster).
        tied = [t for t in eligible if t.score >= fastest * (1.0 - speed_noise)]
        best = max(tied, key=lambda t: (t.accuracy, t.score))
        others = ", ".join(
            f"{t.settings.label} {t.score:.2f}x/{100 * t.accuracy:.2f}%"
            for t in trials
            if t is not best
        )
        reason = (
            f"{best.settings.label}: the fastest setting within {100 * tolerance:.1f} points of"
            f" FP32 (speed-up {best.score:.2f}x, geometric mean over batches {list(batches)};"
            f" settings within {100 * speed_noise:.0f}% of the fastest count as tied and the"
            f" more accurate of those wins; validation top-1 {100 * best.accuracy:.2f}%."
            f" Others: {others})"
        )
    else:
        best = max(trials, key=lambda t: t.accuracy)
        reason = (
            f"no setting is within {100 * tolerance:.1f} points of FP32;"
            f" kept the most accurate, {best.settings.label}"
        )
    selection = QuantSelection(
        chosen=best.settings,
        fp32_accuracy=fp32_acc,
        fp32_latency_ms={b: round(v, 4) for b, v in fp32_lat.items()},
        trials=trials,
        tolerance=tolerance,
        reason=reason,
        threads=threads,
        eval_frames=len(eval_set),
    )
    return selection, paths
