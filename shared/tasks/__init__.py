"""The task seam: what a model answers, and everything that follows from it.

A *task* (``docs/architecture.md``, "The task contract") decides, for every part of
the loop, what is specific to the kind of answer a model gives:

========================  ==============================================================
model output              :meth:`Task.answers` turns a batch of raw outputs into answers
routing signals           :meth:`Task.signals`: the numbers the edge's rules read
message encoding          :meth:`Task.sample_fields` / :meth:`Task.sample_answer` (the
                          edge's answer in a sample header), :meth:`Task.verdict_fields`
                          / :meth:`Task.verdict_answer` (the teacher's, in a verdict)
student vs teacher        :meth:`Task.compare`: agreement and the named differences
review label              :attr:`Task.review_label`: what a human confirms or corrects
gate metric               :attr:`Task.gate_metric` and :meth:`Task.score`
training loss and head    ``distill.tasks`` (torch lives there, not here)
export formats            :attr:`Task.export_formats`
========================  ==============================================================

Classification (``shared.tasks.classification``) is the first implementation,
detection (``shared.tasks.detection``) the second. Code outside a task asks the task;
nothing else in the loop looks inside an answer. Contracts layer: numpy only, no
runtime imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from shared.tasks.classification import CLASSIFICATION, ClassificationTask
from shared.tasks.contract import Answer, Box, Comparison, Signals, Task
from shared.tasks.detection import DETECTION, DetectionSignals, DetectionTask

__all__ = [
    "CLASSIFICATION",
    "DETECTION",
    "TASKS",
    "Answer",
    "Box",
    "ClassificationTask",
    "Comparison",
    "DetectionSignals",
    "DetectionTask",
    "Signals",
    "Task",
    "task_for",
]


TASKS: Mapping[str, Task] = MappingProxyType(
    {CLASSIFICATION.name: CLASSIFICATION, DETECTION.name: DETECTION}
)


def task_for(name: str | None) -> Task:
    """The task of a model or a fleet; ``None`` (a model from before tasks) is classification."""
    if name is None:
        return CLASSIFICATION
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}") from None
