"""Fixtures for simulations and ``edgeloop`` command tests; the quick reference pair is in
tests/conftest.py."""

from __future__ import annotations

import pytest

from distill.cache import ReferenceConfig
from distill.frames import FrameSet
from distill.scenario import render_split


@pytest.fixture(scope="session")
def small_test_set() -> FrameSet:
    """A class-balanced sample of 120 test frames of the quick scenario."""
    scenario = ReferenceConfig.reference(quick=True).scenario
    return render_split("test", scenario).subset(slice(0, 120))
