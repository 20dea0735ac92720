"""The task contract, and classification as its first implementation."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_an_answer_survives_its_message_fields() -> None:
    answer = Answer(2, 0.6, (0.1, 0.3, 0.6))
    assert CLASSIFICATION.decode(CLASSIFICATION.encode(answer)) == answer
    with pytest.raises(ValueError, match="not an index"):
        CLASSIFICATION.decode({"label": 3, "scores": [0.5, 0.5]})


def test_compare_names_the_difference_and_score_is_top1() -> None:
    a, b = Answer(1, 0.9, (0.1, 0.9)), Answer(0, 0.8, (0.8, 0.2))
    assert CLASSIFICATION.compare(a, a).agrees
    assert CLASSIFICATION.compare(a, b).differences == ("wrong_class",)
    assert CLASSIFICATION.score([a, b], [1, 1]) == 0.5
    assert CLASSIFICATION.score([], []) == 0.0
