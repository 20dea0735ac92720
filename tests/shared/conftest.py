"""Fixtures for the shared contracts: real PIL-encoded images, headers, hypothesis strategies."""

from __future__ import annotations

import io
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import strategies as st
from PIL import Image

from shared.ids import new_sample_id
from shared.images import probe_image
from shared.messages import SampleHeader
from shared.topics import ID_PATTERN

HeaderFactory = Callable[..., SampleHeader]
ImageEncoder = Callable[..., bytes]


def _encode_image(size: tuple[int, int], mode: str = "RGB", fmt: str = "PNG", **save: Any) -> bytes:
    """A noisy image of ``size`` and ``mode``, encoded by PIL as ``fmt``."""
    image = Image.effect_noise(size, 48).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


@pytest.fixture(scope="session")
def encode_image() -> ImageEncoder:
    """``encode_image(size, mode="RGB", fmt="PNG", **save)``: a noisy image encoded by PIL."""
    return _encode_image


@pytest.fixture(scope="session")
def small_images() -> dict[str, bytes]:
    """A few small real images (PNG and JPEG, baseline and progressive) by name."""
    return {
        "png-rgb-8x6": _encode_image((8, 6), "RGB", "PNG"),
        "png-l-1x1": _encode_image((1, 1), "L", "PNG"),
        "png-rgba-17x3": _encode_image((17, 3), "RGBA", "PNG"),
        "jpeg-rgb-16x16": _encode_image((16, 16), "RGB", "JPEG", quality=80),
        "jpeg-l-9x5": _encode_image((9, 5), "L", "JPEG"),
        "jpeg-progressive-33x21": _encode_image((33, 21), "RGB", "JPEG", progressive=True),
    }


@pytest.fixture(scope="session")
def make_header() -> HeaderFactory:
    """Build a valid SampleHeader describing ``image``; keyword arguments override fields."""

    def build(image: bytes, **overrides: Any) -> SampleHeader:
        info = probe_image(image)
        fields: dict[str, Any] = {
            "sample_id": new_sample_id(),
            "fleet": "plant-3",
            "agent": "cam-017",
            "captured_at": datetime(2025, 6, 1, 12, 30, 15, 123456, tzinfo=UTC),
            "model_name": "resnet18-student",
            "model_version": "1.4.0",
            "scores": [0.1, 0.7, 0.2],
            "predicted": 1,
            "confidence": 0.7,
            "route_reason": "margin",
            "priority": 3,
            "image_format": info.format,
            "image_width": info.width,
            "image_height": info.height,
            "image_bytes": len(image),
        }
        fields.update(overrides)
        return SampleHeader(**fields)

    return build


# --- hypothesis strategies ----------------------------------------------------

ids = st.from_regex(ID_PATTERN, fullmatch=True)
sample_ids = st.builds(lambda _: new_sample_id(), st.none())
utc_datetimes = st.datetimes(
    min_value=datetime(1971, 1, 1),
    max_value=datetime(9990, 1, 1),
    timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30)), timezone.min]),
)
short_text = st.text(
    alphabet=st.characters(min_codepoint=0x20, exclude_categories=("Cs", "Cc")),
    min_size=1,
    max_size=40,
)
finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)
probability = st.floats(min_value=0.0, max_value=1.0)


@st.composite
def score_lists(draw: st.DrawFn, max_size: int = 30) -> tuple[list[float], int]:
    """Scores and a valid index into them."""
    scores = draw(st.lists(finite, min_size=1, max_size=max_size))
    return scores, draw(st.integers(0, len(scores) - 1))


@st.composite
def header_fields(draw: st.DrawFn) -> dict[str, Any]:
    """Every SampleHeader field except the image ones."""
    scores, predicted = draw(score_lists())
    return {
        "sample_id": draw(sample_ids),
        "fleet": draw(ids),
        "agent": draw(ids),
        "captured_at": draw(utc_datetimes),
        "model_name": draw(short_text),
        "model_version": draw(short_text),
        "scores": scores,
        "predicted": predicted,
        "confidence": draw(probability),
        "route_reason": draw(
            st.sampled_from(
                ["low_confidence", "margin", "entropy", "class_threshold", "audit", "manual"]
            )
        ),
        "priority": draw(st.integers(0, 9)),
        "meta": draw(
            st.dictionaries(st.text(min_size=1, max_size=20), st.text(max_size=40), max_size=4)
        ),
    }


@pytest.fixture(scope="session")
def header_strategy() -> st.SearchStrategy[dict[str, Any]]:
    """Hypothesis strategy for SampleHeader fields (draw it with ``st.data()``)."""
    return header_fields()


@pytest.fixture(scope="session")
def scores_strategy() -> st.SearchStrategy[tuple[list[float], int]]:
    """Hypothesis strategy for a score list and a valid index into it."""
    return score_lists()
