"""Fixtures for distill tests: the quick reference pair, trained once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from distill.cache import ReferenceConfig, ReferenceModels, bootstrap_reference_models
from distill.frames import FrameSet
from distill.scenario import ScenarioConfig, render_split


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def quick_models(model_cache: Path) -> ReferenceModels:
    """The quick reference teacher/student (about 20 s to train on two cores)."""
    return bootstrap_reference_models(model_cache, quick=True)


@pytest.fixture(scope="session")
def quick_scenario() -> ScenarioConfig:
    return ReferenceConfig.reference(quick=True).scenario


@pytest.fixture(scope="session")
def quick_test_set(quick_scenario: ScenarioConfig) -> FrameSet:
    return render_split("test", quick_scenario)


@pytest.fixture(scope="session")
def small_test_set(quick_test_set: FrameSet) -> FrameSet:
    """A class-balanced sample of 120 test frames for cheap checks."""
    return quick_test_set.subset(slice(0, 120))
