"""The verdict stage's take of the teacher's results: what waits, and when."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import numpy as np

from cloud_service.metrics import CloudMetrics
from cloud_service.settings import CloudSettings
from cloud_service.verdicts import VerdictStage
from cloud_service.verifier import TeacherModel


class _Arrivals(queue.Queue[Any]):
    """The results queue, with the teacher's next batch arriving while a take waits."""

    def __init__(self, later: list[Any]) -> None:
        super().__init__()
        self.later = later
        self.waits: list[float | None] = []

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if block and self.empty() and self.later:
            self.waits.append(timeout)
            self.put(self.later.pop(0))
        return super().get(block, timeout)


def _stage(make_settings: Callable[..., CloudSettings]) -> VerdictStage:
    settings = make_settings(max_batch_size=4)
    return VerdictStage(
        settings,
        teacher=TeacherModel(settings.resolved_teacher_model),
        sessions=None,  # type: ignore[arg-type]  # nothing is stored here
        metrics=CloudMetrics(),
        counts={},
        publish=lambda topic, payload: None,
    )


def test_without_a_backlog_results_go_on_at_once(
    make_settings: Callable[..., CloudSettings],
) -> None:
    stage = _stage(make_settings)
    arrivals = _Arrivals(later=[["second batch"]])
    arrivals.put(["first batch"])
    stage._results = arrivals
    assert stage._take_results() == ["first batch"]
    assert arrivals.waits == []  # the next batch was not waited for


def test_under_a_backlog_the_next_batch_shares_the_transaction(
    make_settings: Callable[..., CloudSettings],
) -> None:
    stage = _stage(make_settings)
    pixels = np.zeros((8, 8, 3), np.uint8)
    # A full batch waits for the teacher (not started: it stays queued).
    stage.batcher.queue_many([(object(), pixels.shape, 0, 0.0) for _ in range(4)])  # type: ignore[misc]
    assert stage.batcher.depth == 4
    arrivals = _Arrivals(later=[["second batch", "its other result"]])
    arrivals.put(["first batch"])
    stage._results = arrivals
    assert stage._take_results() == ["first batch", "second batch", "its other result"]
    assert len(arrivals.waits) == 1 and arrivals.waits[0] is not None  # a bounded wait
    # Nothing more comes: the take returns what it has once the wait runs out.
    arrivals.later = []
    arrivals.put(["third batch"])
    stage._results = arrivals
    assert stage._take_results() == ["third batch"]
