"""Each routing strategy, the audit share, budgets and priorities (pure, clock injected)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from edge_agent.routing import AUDIT_PRIORITY, Router, RoutingPolicy, uncertainty
from shared.tasks import CLASSIFICATION, DETECTION


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def router(**policy: object) -> tuple[Router, FakeClock]:
    clock = FakeClock()
    base: dict[str, object] = {"max_prob_below": None}
    base.update(policy)
    return Router(
        RoutingPolicy(**base),  # type: ignore[arg-type]
        labels=["cat", "dog", "bird"],
        clock=clock,
        rng=random.Random(0),
    ), clock


CONFIDENT = np.array([0.96, 0.03, 0.01])
CLOSE_CALL = np.array([0.48, 0.47, 0.05])  # low max prob and a small margin
FLAT = np.array([0.34, 0.33, 0.33])


def test_uncertainty_measures() -> None:
    predicted, top, margin, entropy = uncertainty(CLOSE_CALL)
    assert predicted == 0
    assert top == pytest.approx(0.48)
    assert margin == pytest.approx(0.01)
    expected = -sum(p * math.log(p) for p in CLOSE_CALL)
    assert entropy == pytest.approx(expected)


def test_low_confidence() -> None:
    r, _ = router(max_prob_below=0.6)
    assert r.decide(CLOSE_CALL).reason == "low_confidence"
    assert r.decide(CLOSE_CALL).forward
    assert not r.decide(CONFIDENT).forward


def test_margin() -> None:
    r, _ = router(margin_below=0.1)
    decision = r.decide(CLOSE_CALL)
    assert (decision.forward, decision.reason) == (True, "margin")
    assert not r.decide(CONFIDENT).forward


def test_entropy() -> None:
    r, _ = router(entropy_above=1.0)
    assert r.decide(FLAT).reason == "entropy"
    assert not r.decide(CLOSE_CALL).forward  # entropy ~0.87 nats
    assert not r.decide(CONFIDENT).forward


def test_class_thresholds_by_label_and_index() -> None:
    r, _ = router(class_thresholds={"cat": 0.99})
    assert r.decide(CONFIDENT).reason == "class_threshold"  # cat at 0.96 < 0.99
    dog = np.array([0.02, 0.97, 0.01])
    assert not r.decide(dog).forward  # no threshold for dog
    r2, _ = router(class_thresholds={"1": 0.98})
    assert r2.decide(dog).reason == "class_threshold"


def test_order_decides_the_reason() -> None:
    r, _ = router(max_prob_below=0.6, margin_below=0.1, order=("margin", "low_confidence"))
    assert r.decide(CLOSE_CALL).reason == "margin"
    r2, _ = router(max_prob_below=0.6, margin_below=0.1)
    assert r2.decide(CLOSE_CALL).reason == "low_confidence"


def test_audit_share_of_confident_frames() -> None:
    r, _ = router(max_prob_below=0.6, audit_share=0.1)
    decisions = [r.decide(CONFIDENT) for _ in range(5000)]
    audits = [d for d in decisions if d.forward]
    assert all(d.reason == "audit" and d.priority == AUDIT_PRIORITY for d in audits)
    assert 0.08 < len(audits) / 5000 < 0.12
    # Unsure frames are forwarded for their own reason, never as audits.
    assert r.decide(CLOSE_CALL).reason == "low_confidence"


def test_no_audit_when_share_is_zero() -> None:
    r, _ = router(audit_share=0.0)
    assert not any(r.decide(CONFIDENT).forward for _ in range(1000))


@pytest.mark.parametrize(
    ("budget", "window"), [("per_minute", 60.0), ("per_hour", 3600.0), ("per_day", 86400.0)]
)
def test_budgets(budget: str, window: float) -> None:
    r, clock = router(max_prob_below=0.6, **{budget: 3})
    forwarded = [r.decide(CLOSE_CALL) for _ in range(5)]
    assert [d.forward for d in forwarded] == [True, True, True, False, False]
    assert forwarded[-1].over_budget and forwarded[-1].reason == "low_confidence"
    assert r.over_budget == 2
    clock.now += window - 1
    assert not r.decide(CLOSE_CALL).forward  # the window has not passed yet
    clock.now += 1.5
    assert r.decide(CLOSE_CALL).forward  # the first three expired


def test_budgets_combine() -> None:
    r, clock = router(max_prob_below=0.6, per_minute=2, per_hour=3)
    assert [r.decide(CLOSE_CALL).forward for _ in range(3)] == [True, True, False]
    clock.now += 61
    assert [r.decide(CLOSE_CALL).forward for _ in range(2)] == [True, False]  # hour caps at 3


def test_priority_follows_uncertainty() -> None:
    r, _ = router(max_prob_below=1.01)
    flat = r.decide(FLAT).priority
    close = r.decide(CLOSE_CALL).priority
    sure = r.decide(CONFIDENT).priority
    assert flat < close < sure <= 8
    assert flat == 0


def test_decide_batch_decides_as_decide_does_row_by_row() -> None:
    rng = np.random.default_rng(3)
    scores = rng.dirichlet(np.ones(5) * 0.7, size=64).astype(np.float32)
    policy = RoutingPolicy(
        max_prob_below=0.5, margin_below=0.1, entropy_above=1.2, audit_share=0.3, per_minute=9
    )
    one = Router(policy, labels=list("abcde"), clock=lambda: 100.0, rng=random.Random(7))
    many = Router(policy, labels=list("abcde"), clock=lambda: 100.0, rng=random.Random(7))
    expected = [one.decide(row) for row in scores]
    got = many.decide_batch(scores[:40]) + many.decide_batch(scores[40:])
    assert [(d.forward, d.reason, d.priority, d.predicted, d.over_budget) for d in got] == [
        (d.forward, d.reason, d.priority, d.predicted, d.over_budget) for d in expected
    ]
    for g, e in zip(got, expected, strict=True):
        assert g.confidence == e.confidence
        assert g.margin == pytest.approx(e.margin, abs=1e-12)
        assert g.entropy == pytest.approx(e.entropy, abs=1e-12)
    assert many.over_budget == one.over_budget > 0


def test_uncertainties_matches_uncertainty_per_row_even_for_one_class() -> None:
    from edge_agent.routing import uncertainties

    for batch in (np.array([[1.0], [0.5]]), np.array([[0.1, 0.7, 0.2], [0.5, 0.5, 0.0]])):
        rows = list(zip(*uncertainties(batch), strict=True))
        assert rows == [pytest.approx(uncertainty(row)) for row in batch]


def test_the_router_answers_through_the_models_task() -> None:
    router = Router(RoutingPolicy(max_prob_below=0.6), clock=lambda: 0.0, task=CLASSIFICATION)
    assert router.task is CLASSIFICATION
    decisions = router.decide_batch(np.array([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]]))
    assert [d.forward for d in decisions] == [True, False]
    assert decisions[0].reason == "low_confidence"


# --- detection -------------------------------------------------------------------------


def detector_router(**policy: object) -> tuple[Router, FakeClock]:
    clock = FakeClock()
    return Router(
        RoutingPolicy(**{"max_prob_below": None, **policy}),  # type: ignore[arg-type]
        labels=[str(d) for d in range(10)],
        clock=clock,
        rng=random.Random(0),
        task=DETECTION,
    ), clock


def frame(*scores: float) -> np.ndarray:
    """One detector frame: a box per score (class 3), padded to 8 rows."""
    rows = np.zeros((8, 6), np.float32)
    for i, score in enumerate(scores):
        rows[i] = (0.1 * i, 0.1, 0.1 * i + 0.08, 0.2, score, 3)
    return rows


def reasons(r: Router, *frames: np.ndarray) -> list[str | None]:
    return [d.reason if d.forward else None for d in r.decide_batch(np.stack(frames))]


def test_each_detection_rule_fires_alone() -> None:
    sure, unsure = frame(0.95, 0.9), frame(0.95, 0.4, 0.35)
    r, _ = detector_router(mean_score_below=0.6)
    assert reasons(r, sure, unsure, frame()) == [None, "mean_score", None]  # empty: no mean
    r, _ = detector_router(low_share_above=0.5)  # Sedna's IBT: 2 of 3 boxes below 0.5
    assert reasons(r, sure, unsure) == [None, "low_score_share"]
    r, _ = detector_router(near_threshold_at_least=2)  # 0.35 and 0.25 within 0.1 of 0.3
    assert reasons(r, sure, frame(0.9, 0.35, 0.25)) == [None, "near_threshold"]
    r, _ = detector_router(box_count_range=(1, 2))
    assert reasons(r, sure, unsure, frame()) == [None, "box_count", "box_count"]


def test_detection_rules_combine_in_order_and_the_first_names_the_reason() -> None:
    unsure = frame(0.95, 0.4, 0.35)
    r, _ = detector_router(mean_score_below=0.6, low_share_above=0.5)
    assert r.order[:2] == ("mean_score", "low_score_share")
    assert reasons(r, unsure) == ["mean_score"]
    r, _ = detector_router(
        mean_score_below=0.6, low_share_above=0.5, order=("low_score_share", "mean_score")
    )
    assert reasons(r, unsure) == ["low_score_share"]


def test_empty_frames_are_audited_by_their_own_share_and_budgets_hold() -> None:
    r, _ = detector_router(empty_audit_share=1.0)
    empty = r.decide(frame())
    assert empty.forward and empty.reason == "empty_audit" and empty.priority == AUDIT_PRIORITY
    assert not r.decide(frame(0.9)).forward  # a frame with boxes is not an empty one
    r, _ = detector_router(empty_audit_share=0.25)
    audited = sum(d.forward for d in r.decide_batch(np.stack([frame()] * 400)))
    assert 60 <= audited <= 140  # a quarter of 400, drawn
    r, clock = detector_router(mean_score_below=0.6, per_minute=1)
    first, second = r.decide_batch(np.stack([frame(0.4), frame(0.4)]))
    assert first.forward and second.over_budget and r.over_budget == 1
    clock.now += 61
    assert r.decide(frame(0.4)).forward


def test_classification_rules_do_not_apply_to_a_detector() -> None:
    with pytest.raises(ValueError, match="do not apply to the detection task"):
        detector_router(order=("low_confidence",))
    r, _ = detector_router(mean_score_below=0.6)
    assert "low_confidence" not in r.order
