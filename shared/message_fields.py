"""The field types of the JSON messages (``shared.messages``) and their checks.

Identifiers are checked as ``shared.ids`` and ``shared.topics`` define them; text
carries no control characters; scores, confidences and box coordinates are rounded
to ``SCORE_DIGITS`` significant digits when a message is built (see the
``shared.messages`` docstring for why four); a detector's boxes are fractions of the
frame with a score and a class index.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from shared.errors import EdgeLoopError
from shared.ids import validate_sample_id
from shared.topics import validate_id

__all__ = [
    "SCORE_DIGITS",
    "AgentId",
    "Boxes",
    "Confidence",
    "Count",
    "Dimension",
    "FleetId",
    "NonNegative",
    "Rate",
    "SampleId",
    "Scores",
    "ShortText",
    "check_answer",
]

SCORE_DIGITS = 4


def _pydantic(check: Any, *args: Any) -> Any:
    """Wrap a validator raising our errors into one raising ValueError (what pydantic wants)."""

    def run(value: Any) -> Any:
        try:
            return check(value, *args)
        except EdgeLoopError as exc:
            raise ValueError(exc.message) from None

    return run


_CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f]")


def _no_control_chars(value: str) -> str:
    if _CONTROL_CHARS.search(value):
        raise ValueError("text must not contain control characters")
    return value


_SCORE_FORMAT = f"%.{SCORE_DIGITS}g"


def _round_scores(values: list[float]) -> list[float]:
    """Round each to SCORE_DIGITS significant digits (the shortest JSON form of that
    value); one validator call for a whole list of scores, not one per element."""
    rounded = [float(_SCORE_FORMAT % value) for value in values]
    if not all(map(math.isfinite, rounded)):  # 1.7977e308 rounds up to infinity
        raise ValueError("value is too large")
    return rounded


def _round_score(value: float) -> float:
    return _round_scores([value])[0]


SampleId = Annotated[str, AfterValidator(_pydantic(validate_sample_id))]
FleetId = Annotated[str, AfterValidator(_pydantic(validate_id, "fleet"))]
AgentId = Annotated[str, AfterValidator(_pydantic(validate_id, "agent"))]
ShortText = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_no_control_chars)]
# A classifier's scores (one per class), or a detector's (one per box: none on an
# empty frame); the message's own check says which.
Scores = Annotated[list[float], Field(max_length=1000), AfterValidator(_round_scores)]
Confidence = Annotated[float, Field(ge=0.0, le=1.0), AfterValidator(_round_score)]
Rate = Annotated[float, Field(ge=0.0, le=1.0)]
NonNegative = Annotated[float, Field(ge=0.0)]
Count = Annotated[int, Field(ge=0)]
Dimension = Annotated[int, Field(ge=1, le=2**31 - 1)]


def _check_box(box: list[float]) -> list[float]:
    box = _round_scores(box)
    x1, y1, x2, y2, score, cls = box
    if not (0.0 <= x1 <= x2 <= 1.0 and 0.0 <= y1 <= y2 <= 1.0):
        raise ValueError("a box's corners are fractions of the frame with x1 <= x2, y1 <= y2")
    if not 0.0 <= score <= 1.0:
        raise ValueError("a box's score is within [0, 1]")
    if cls != int(cls) or not 0 <= cls < 100_000:
        raise ValueError("a box's class is a class index")
    return box


# A detected object (shared.tasks.detection): x1, y1, x2, y2 as fractions of the
# frame, score, class index.
DetectedBox = Annotated[list[float], Field(min_length=6, max_length=6), AfterValidator(_check_box)]
Boxes = Annotated[list[DetectedBox], Field(max_length=300)]


def check_answer(
    scores: list[float], index: int, boxes: list[list[float]] | None, what: str
) -> None:
    """A classifier's answer: ``index`` into the scores; a detector's: a score per box."""
    if boxes is None:
        if index >= len(scores):
            raise ValueError(f"{what} {index} is not an index into the scores")
    elif len(scores) != len(boxes):
        raise ValueError(f"{len(scores)} scores for {len(boxes)} boxes")
