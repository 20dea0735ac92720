"""Which frames go to the cloud: strategies in order, an audit share, and budgets.

Pure and clock-injected, so each rule is tested without threads or a broker:

    router = Router(RoutingPolicy(max_prob_below=0.6, audit_share=0.01), clock=time.monotonic)
    decision = router.decide(scores)   # Decision(forward, reason, priority, ...)
    decisions = router.decide_batch(batch_scores)   # one per row, as decide would in order

Strategies run in the order of ``RoutingPolicy.order``; the first that fires names
the reason. A confident frame is forwarded as an audit sample with probability
``audit_share`` (drawn independently of its scores, so the cloud's estimate of edge
accuracy on confident frames is unbiased). Budgets (per minute, hour, day) cap what
is forwarded; a frame over budget is answered but not forwarded and counted.
Priority (0 most urgent .. 9) grows with how unsure the student was; audit samples
get the lowest priority.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from shared.tasks import CLASSIFICATION, DetectionSignals, Signals, Task

__all__ = [
    "Budget",
    "Decision",
    "Router",
    "RoutingPolicy",
    "Strategy",
    "uncertainties",
    "uncertainty",
]

Strategy = Literal[
    # classification
    "low_confidence",
    "margin",
    "entropy",
    "class_threshold",
    # detection
    "mean_score",
    "low_score_share",
    "near_threshold",
    "box_count",
]
DEFAULT_ORDER: tuple[Strategy, ...] = ("low_confidence", "margin", "entropy", "class_threshold")
DETECTION_ORDER: tuple[Strategy, ...] = (
    "mean_score",
    "low_score_share",
    "near_threshold",
    "box_count",
)
AUDIT_PRIORITY = 9


@dataclass(frozen=True)
class RoutingPolicy:
    """The routing knobs; ``None`` turns a strategy or a budget off."""

    max_prob_below: float | None = 0.6
    margin_below: float | None = None
    entropy_above: float | None = None  # in nats
    class_thresholds: Mapping[str, float] = field(default_factory=dict)  # label -> min confidence
    audit_share: float = 0.0
    # Detection (shared.tasks.detection): the mean box score below a threshold; the
    # share of kept boxes below the task's low score above a threshold (KubeEdge
    # Sedna's IBT rule); at least this many candidates near the score threshold; a
    # box count outside [min, max]. An empty frame is never unsure by those rules, so
    # a share of empty frames is audited (missed objects are the costliest errors).
    mean_score_below: float | None = None
    low_share_above: float | None = None
    near_threshold_at_least: int | None = None
    box_count_range: tuple[int, int] | None = None
    empty_audit_share: float = 0.0
    # The strategies in order; None: those of the model's task, in the task's order.
    order: tuple[Strategy, ...] | None = None
    per_minute: int | None = None
    per_hour: int | None = None
    per_day: int | None = None


@dataclass(frozen=True)
class Decision:
    """What to do with one frame."""

    forward: bool
    reason: str | None  # a shared RouteReason when forwarded or over budget
    priority: int
    confidence: float
    predicted: int
    margin: float
    entropy: float
    over_budget: bool = False


class Budget:
    """At most ``limit`` events in any window of ``window_s`` seconds (sliding log)."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self._times: deque[float] = deque()

    def _expire(self, now: float) -> None:
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()

    def available(self, now: float) -> bool:
        self._expire(now)
        return len(self._times) < self.limit

    def take(self, now: float) -> None:
        self._times.append(now)

    def used(self, now: float) -> int:
        self._expire(now)
        return len(self._times)


def uncertainty(scores: np.ndarray) -> tuple[int, float, float, float]:
    """(predicted, max probability, top-2 margin, entropy in nats) of a probability row."""
    predicted, top, margin, entropy = uncertainties(np.asarray(scores)[None, :])
    return predicted[0], top[0], margin[0], entropy[0]


def uncertainties(
    scores: np.ndarray, task: Task = CLASSIFICATION
) -> tuple[list[int], list[float], list[float], list[float]]:
    """``uncertainty`` for each row of a batch of outputs: the task's routing signals."""
    s = task.signals(scores)
    return s.predicted, s.confidence, s.margin, s.entropy


def _priority(confidence: float, floor: float) -> int:
    """0 (least sure: confidence at ``floor``, e.g. near-uniform scores) .. 8 (nearly sure)."""
    span = max(1e-9, 1.0 - floor)
    sureness = min(1.0, max(0.0, (confidence - floor) / span))
    return min(8, math.floor(sureness * 9))


class Router:
    """Applies a RoutingPolicy to score rows; keeps budget state. Not thread-safe by itself."""

    def __init__(
        self,
        policy: RoutingPolicy,
        *,
        labels: list[str] | None = None,
        clock: Callable[[], float],
        rng: random.Random | None = None,
        task: Task = CLASSIFICATION,
    ) -> None:
        order = policy.order if policy.order is not None else _task_order(task)
        unknown = [rule for rule in order if rule not in task.routing_rules]
        if unknown:
            raise ValueError(
                f"routing rules {unknown} do not apply to the {task.name} task"
                f" (its rules: {', '.join(task.routing_rules)})"
            )
        self.policy = policy
        self.order: tuple[Strategy, ...] = order
        self.task = task
        self.labels = labels or []
        self._clock = clock
        self._rng = rng or random.Random()
        self._budgets = [
            Budget(limit, window)
            for limit, window in (
                (policy.per_minute, 60.0),
                (policy.per_hour, 3600.0),
                (policy.per_day, 86400.0),
            )
            if limit is not None
        ]
        self.over_budget = 0

    def _fires(self, strategy: Strategy, s: Signals, i: int) -> bool:
        p = self.policy
        if strategy == "low_confidence":
            return p.max_prob_below is not None and s.confidence[i] < p.max_prob_below
        if strategy == "margin":
            return p.margin_below is not None and s.margin[i] < p.margin_below
        if strategy == "entropy":
            return p.entropy_above is not None and s.entropy[i] > p.entropy_above
        if strategy == "class_threshold":
            predicted = s.predicted[i]
            label = self.labels[predicted] if predicted < len(self.labels) else str(predicted)
            threshold = p.class_thresholds.get(label, p.class_thresholds.get(str(predicted)))
            return threshold is not None and s.confidence[i] < threshold
        if not isinstance(s, DetectionSignals):
            raise ValueError(f"routing rule {strategy!r} needs a detector's signals")
        if strategy == "mean_score":
            return (
                p.mean_score_below is not None
                and s.box_count[i] > 0
                and s.confidence[i] < p.mean_score_below
            )
        if strategy == "low_score_share":
            return p.low_share_above is not None and s.low_share[i] > p.low_share_above
        if strategy == "near_threshold":
            return (
                p.near_threshold_at_least is not None
                and s.near_count[i] >= p.near_threshold_at_least
            )
        if strategy == "box_count":
            if p.box_count_range is None:
                return False
            low, high = p.box_count_range
            return not low <= s.box_count[i] <= high
        raise ValueError(f"unknown routing strategy {strategy!r}")

    def decide(self, scores: np.ndarray) -> Decision:
        """The decision for one frame's output (budgets and the audit draw advance)."""
        return self.decide_batch(np.asarray(scores)[None])[0]

    def decide_batch(self, outputs: np.ndarray) -> list[Decision]:
        """``decide`` for each frame of a batch of outputs, in order, in one numpy pass."""
        signals = self.task.signals(outputs)
        # How sure a frame can look at worst: a uniform row for a classifier, no
        # confidence at all for a detector's mean box score.
        floor = 0.0 if isinstance(signals, DetectionSignals) else 1.0 / int(np.shape(outputs)[1])
        return [self._decide(signals, i, floor) for i in range(len(signals))]

    def _decide(self, s: Signals, i: int, floor: float) -> Decision:
        reason: str | None = None
        for strategy in self.order:
            if self._fires(strategy, s, i):
                reason = strategy
                break
        top, predicted, margin, ent = s.confidence[i], s.predicted[i], s.margin[i], s.entropy[i]
        priority = _priority(top, floor)
        empty = isinstance(s, DetectionSignals) and s.box_count[i] == 0
        # Drawn for every confident frame, independent of its scores: an unbiased audit.
        # An empty frame has an audit share of its own.
        if reason is None and empty and self._rng.random() < self.policy.empty_audit_share:
            reason, priority = "empty_audit", AUDIT_PRIORITY
        elif reason is None and self._rng.random() < self.policy.audit_share:
            reason, priority = "audit", AUDIT_PRIORITY
        if reason is None:
            return Decision(False, None, priority, top, predicted, margin, ent)
        now = self._clock()
        if not all(b.available(now) for b in self._budgets):
            self.over_budget += 1
            return Decision(False, reason, priority, top, predicted, margin, ent, over_budget=True)
        for budget in self._budgets:
            budget.take(now)
        return Decision(True, reason, priority, top, predicted, margin, ent)


def _task_order(task: Task) -> tuple[Strategy, ...]:
    """A task's routing rules as strategies, in the task's order."""
    return tuple(rule for rule in (*DEFAULT_ORDER, *DETECTION_ORDER) if rule in task.routing_rules)
