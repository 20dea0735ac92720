"""Fixtures for distill tests; the quick reference pair and scenario are in tests/conftest.py."""

from __future__ import annotations

import pytest

from distill.frames import FrameSet
from distill.scenario import ScenarioConfig, render_split


@pytest.fixture(scope="session")
def quick_test_set(quick_scenario: ScenarioConfig) -> FrameSet:
    return render_split("test", quick_scenario)


@pytest.fixture(scope="session")
def small_test_set(quick_test_set: FrameSet) -> FrameSet:
    """A class-balanced sample of 120 test frames for cheap checks."""
    return quick_test_set.subset(slice(0, 120))
