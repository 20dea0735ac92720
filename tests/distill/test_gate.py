"""The release rule: better on recent data, no worse on the reference set or under drift,
INT8 close to its FP32 (with an allowance for noise on a small holdout)."""

from __future__ import annotations

from distill.gate import gate


def test_gate_refuses_a_worse_model() -> None:
    worse = {
        "new_fp32": {"holdout": 0.70, "reference": 0.90},
        "new_int8": {"holdout": 0.70, "reference": 0.90},
        "serving": {"holdout": 0.75, "reference": 0.90},
    }
    decision = gate(worse, min_gain=0.0, max_reference_drop=0.02, int8_tolerance=0.02)
    assert not decision.passed and "no better on recent data" in decision.reasons[0]

    forgets = {
        "new_fp32": {"holdout": 0.95, "reference": 0.80},
        "new_int8": {"holdout": 0.95, "reference": 0.80},
        "serving": {"holdout": 0.60, "reference": 0.90},
    }
    decision = gate(forgets, min_gain=0.0, max_reference_drop=0.02, int8_tolerance=0.02)
    assert not decision.passed and "falls on the reference set" in decision.reasons[0]

    int8_off = {
        "new_fp32": {"holdout": 0.95, "reference": 0.95},
        "new_int8": {"holdout": 0.85, "reference": 0.93},
        "serving": {"holdout": 0.60, "reference": 0.90},
    }
    decision = gate(int8_off, min_gain=0.0, max_reference_drop=0.02, int8_tolerance=0.02)
    assert not decision.passed and "INT8 is 0.100 from its FP32" in decision.reasons[0]

    better = {
        "new_fp32": {"holdout": 0.95, "reference": 0.90},
        "new_int8": {"holdout": 0.94, "reference": 0.90},
        "serving": {"holdout": 0.60, "reference": 0.90},
    }
    assert gate(better, min_gain=0.0, max_reference_drop=0.02, int8_tolerance=0.02).passed


def test_the_int8_check_allows_for_noise_on_a_small_holdout() -> None:
    def evaluation(int8_holdout: float) -> dict[str, dict[str, float]]:
        return {
            "new_fp32": {"holdout": 81 / 83, "reference": 0.97},
            "new_int8": {"holdout": int8_holdout, "reference": 0.97},
            "serving": {"holdout": 0.66, "reference": 0.97},
        }

    sizes = {"holdout": 83, "reference": 720}
    knobs = {"min_gain": 0.0, "max_reference_drop": 0.02, "int8_tolerance": 0.02}
    # Two frames of 83 (2.4 points) are within two standard errors of none: counted as 0.
    two = gate(evaluation(79 / 83), sizes=sizes, **knobs)
    assert two.passed and two.checks["int8_gap_raw"]["holdout"] == round(2 / 83, 4)
    # Without the sizes the raw 2.4 points count and the model is refused.
    assert not gate(evaluation(79 / 83), **knobs).passed
    # Eight frames (9.6 points; 2.8 beyond the noise allowance) are refused.
    eight = gate(evaluation(73 / 83), sizes=sizes, **knobs)
    assert not eight.passed and "0.096 on holdout" in eight.reasons[0]
    assert eight.checks["int8_gap"] == round((8 - 2 * 8**0.5) / 83, 4)


def test_the_gate_can_hold_a_round_to_the_serving_student_under_drift() -> None:
    evaluation = {
        "new_fp32": {"holdout": 0.93, "reference": 0.965, "drift:blur:0.8": 0.925},
        "new_int8": {"holdout": 0.93, "reference": 0.965, "drift:blur:0.8": 0.925},
        "serving": {"holdout": 0.84, "reference": 0.968, "drift:blur:0.8": 0.95},
    }
    knobs = {"min_gain": 0.0, "max_reference_drop": 0.02, "int8_tolerance": 0.02}
    # Reported, not checked, unless asked for.
    lenient = gate(evaluation, **knobs)
    assert lenient.passed and lenient.checks["drift_drop"] == {"drift:blur:0.8": 0.025}
    strict = gate(evaluation, max_drift_drop=0.02, **knobs)
    assert not strict.passed
    assert strict.reasons == (
        "falls under blur:0.8: 0.925 vs serving 0.950 (at most 0.020 lower allowed)",
    )
    assert gate(evaluation, max_drift_drop=0.03, **knobs).passed


def test_the_gate_without_a_reference_set_judges_the_holdout_alone() -> None:
    evaluation = {
        "new_fp32": {"holdout": 0.90},
        "new_int8": {"holdout": 0.89},
        "serving": {"holdout": 0.70},
    }
    decision = gate(evaluation, min_gain=0.0, max_reference_drop=0.02, int8_tolerance=0.02)
    assert decision.passed and decision.checks["reference_drop"] is None
