"""The release rule: a new student replaces the serving one only when it is better on
recent data, no worse on the reference set (and, when asked, under each drift), and its
INT8 model stays close to its own FP32 one. See docs/architecture.md (distillation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["GateDecision", "gate"]


@dataclass(frozen=True)
class GateDecision:
    """The gate's answer: whether it passed, why not, and the numbers it checked."""

    passed: bool
    reasons: tuple[str, ...]
    checks: dict[str, Any]


def gate(
    evaluation: dict[str, dict[str, float]],
    *,
    min_gain: float,
    max_reference_drop: float,
    int8_tolerance: float,
    sizes: Mapping[str, int] | None = None,
    max_drift_drop: float | None = None,
    metric: str = "top1_accuracy",
) -> GateDecision:
    """The release rule. ``evaluation[model][dataset]`` = accuracy; models new_fp32,
    new_int8, serving; datasets holdout and (when there is a reference set) reference.

    ``sizes`` (frames per dataset) makes the INT8 check count what is evidence: the
    recent holdout is a few dozen of the frames the student was least sure of, where
    quantization flips a frame or two by chance. With ``c`` frames of difference on
    ``n``, the gap counted is the lower bound ``(c - 2 sqrt(c)) / n`` (two Poisson
    standard errors); 2 of 83 frames counts as 0, 8 of 83 as 2.8 points.

    ``max_drift_drop`` also holds the new INT8 to the serving student on every
    ``drift:...`` dataset: a round that fits the recent frames but falls on unseen
    scans under the very drift it answers is refused.

    ``metric`` names the figure compared (the task's gate metric); it is recorded in
    the checks beside the numbers.
    """
    new, fp32, old = evaluation["new_int8"], evaluation["new_fp32"], evaluation["serving"]
    gain = new["holdout"] - old["holdout"]
    # A fleet of its own classes with no labelled folder has no reference set to hold to.
    has_reference = "reference" in new and "reference" in old
    ref_drop = old["reference"] - new["reference"] if has_reference else 0.0
    gaps = {d: abs(fp32[d] - new[d]) for d in ("holdout", "reference") if d in new and d in fp32}
    int8_gap = max(
        _gap_lower_bound(gap, sizes[d]) if sizes and sizes.get(d) else gap
        for d, gap in gaps.items()
    )
    reasons = []
    if not gain > min_gain:
        reasons.append(
            f"no better on recent data: INT8 {new['holdout']:.3f} vs serving"
            f" {old['holdout']:.3f} (needs a gain above {min_gain:+.3f})"
        )
    if has_reference and ref_drop > max_reference_drop:
        reasons.append(
            f"falls on the reference set: {new['reference']:.3f} vs serving"
            f" {old['reference']:.3f} (at most {max_reference_drop:.3f} lower allowed)"
        )
    drift_drops = {d: old[d] - new[d] for d in new if d.startswith("drift:") and d in old}
    if max_drift_drop is not None:
        for d, drop in drift_drops.items():
            if drop > max_drift_drop:
                reasons.append(
                    f"falls under {d.removeprefix('drift:')}: {new[d]:.3f} vs serving"
                    f" {old[d]:.3f} (at most {max_drift_drop:.3f} lower allowed)"
                )
    if int8_gap > int8_tolerance:
        worst = max(gaps, key=lambda d: gaps[d])
        reasons.append(
            f"INT8 is {int8_gap:.3f} from its FP32 (tolerance {int8_tolerance:.3f};"
            f" {gaps[worst]:.3f} on {worst} as measured)"
        )
    checks = {
        "metric": metric,
        "holdout_gain": round(gain, 4),
        "reference_drop": round(ref_drop, 4) if has_reference else None,
        "int8_gap": round(int8_gap, 4),
        "int8_gap_raw": {d: round(g, 4) for d, g in gaps.items()},
        "min_gain": min_gain,
        "max_reference_drop": max_reference_drop,
        "int8_tolerance": int8_tolerance,
        "drift_drop": {d: round(v, 4) for d, v in drift_drops.items()},
        "max_drift_drop": max_drift_drop,
    }
    return GateDecision(passed=not reasons, reasons=tuple(reasons), checks=checks)


def _gap_lower_bound(gap: float, n: int) -> float:
    """An accuracy gap on ``n`` frames less two Poisson standard errors of its frame count."""
    count = round(gap * n)
    return max(0.0, (count - 2.0 * math.sqrt(count)) / n)
