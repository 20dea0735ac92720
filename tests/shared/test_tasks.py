"""The task contract, and classification as its first implementation."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np
import pytest

from shared.ids import new_sample_id
from shared.messages import SampleHeader, Verdict
from shared.tasks import CLASSIFICATION, Answer, Task, task_for


def test_classification_is_a_task_and_the_default() -> None:
    assert isinstance(CLASSIFICATION, Task)
    assert task_for(None) is CLASSIFICATION
    assert task_for("classification") is CLASSIFICATION
    with pytest.raises(ValueError, match="unknown task 'segmentation'"):
        task_for("segmentation")


def test_answers_and_signals_read_each_row() -> None:
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.5, 0.0]])
    answers = CLASSIFICATION.answers(scores)
    assert [a.label for a in answers] == [1, 0]
    assert answers[0].confidence == pytest.approx(0.7)
    signals = CLASSIFICATION.signals(scores)
    assert signals.predicted == [1, 0]
    assert signals.margin == pytest.approx([0.5, 0.0])
    assert signals.entropy[1] == pytest.approx(np.log(2))
    with pytest.raises(ValueError, match=r"\[N, classes\]"):
        CLASSIFICATION.signals(np.zeros(3))


SAMPLE_ID = new_sample_id()


def test_an_answer_survives_the_sample_header_and_the_verdict() -> None:
    output = np.array([0.1, 0.3, 0.6000001], dtype=np.float32)
    fields = CLASSIFICATION.sample_fields(output)
    assert fields["predicted"] == 2 and 0.0 <= fields["confidence"] <= 1.0
    header = SampleHeader(
        sample_id=SAMPLE_ID,
        fleet="f",
        agent="a",
        captured_at=datetime.now(UTC),
        model_name="m",
        model_version="1",
        route_reason="low_confidence",
        image_format="jpeg",
        image_width=8,
        image_height=8,
        image_bytes=1,
        **fields,
    )
    edge = CLASSIFICATION.sample_answer(SampleHeader.model_validate_json(header.model_dump_json()))
    assert edge.label == 2 and edge.scores == pytest.approx(output.tolist())

    teacher = Answer(1, 0.7, (0.2, 0.7, 0.1))
    verdict = Verdict(
        sample_id=SAMPLE_ID,
        fleet="f",
        agent="a",
        teacher_model="t",
        teacher_version="1",
        agrees_with_edge=CLASSIFICATION.compare(edge, teacher).agrees,
        verified_at=datetime.now(UTC),
        **CLASSIFICATION.verdict_fields(teacher),
    )
    assert (
        CLASSIFICATION.verdict_answer(Verdict.model_validate_json(verdict.model_dump_json()))
        == teacher
    )
    assert not verdict.agrees_with_edge
    with pytest.raises(ValueError, match="no"):
        CLASSIFICATION.sample_fields(np.zeros(0))


def test_compare_names_the_difference_and_score_is_top1() -> None:
    a, b = Answer(1, 0.9, (0.1, 0.9)), Answer(0, 0.8, (0.8, 0.2))
    assert CLASSIFICATION.compare(a, a).agrees
    assert CLASSIFICATION.compare(a, b).differences == ("wrong_class",)
    assert CLASSIFICATION.score([a, b], [1, 1]) == 0.5
    assert CLASSIFICATION.score([], []) == 0.0
