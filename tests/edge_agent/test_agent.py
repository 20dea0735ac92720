"""The agent's process-wide settings: applied while it runs, given back when it stops."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import pytest

from edge_agent.agent import Agent
from edge_agent.settings import AgentSettings
from edge_agent.testing import MemoryPublisher


def test_the_switch_interval_is_the_agents_while_it_runs(
    make_settings: Callable[..., AgentSettings], engine: object, own_switch_interval: float
) -> None:
    settings = make_settings(switch_interval_ms=0.5)
    with Agent(settings, engine=engine, publisher=MemoryPublisher()):  # type: ignore[arg-type]
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(own_switch_interval)


def test_a_zero_switch_interval_leaves_the_process_alone(
    make_settings: Callable[..., AgentSettings], engine: object, own_switch_interval: float
) -> None:
    settings = make_settings(switch_interval_ms=0)
    with Agent(settings, engine=engine, publisher=MemoryPublisher()):  # type: ignore[arg-type]
        assert sys.getswitchinterval() == pytest.approx(own_switch_interval)
    assert sys.getswitchinterval() == pytest.approx(own_switch_interval)


def test_the_collectors_threshold_is_the_agents_while_it_runs(
    make_settings: Callable[..., AgentSettings], engine: object
) -> None:
    own, frozen = gc.get_threshold(), gc.get_freeze_count()
    settings = make_settings(gc_young_every=50_000)
    with Agent(settings, engine=engine, publisher=MemoryPublisher()):  # type: ignore[arg-type]
        assert gc.get_threshold()[0] == 50_000
        assert gc.get_freeze_count() > frozen  # the model and the agent's parts
    assert gc.get_threshold() == own
    assert gc.get_freeze_count() == frozen


@pytest.mark.parametrize("opencv_threads", [1, 3])
def test_opencvs_threads_are_the_agents_while_it_runs(
    make_settings: Callable[..., AgentSettings], engine: object, opencv_threads: int
) -> None:
    import cv2

    own = cv2.getNumThreads()
    settings = make_settings(opencv_threads=opencv_threads)
    with Agent(settings, engine=engine, publisher=MemoryPublisher()):  # type: ignore[arg-type]
        assert cv2.getNumThreads() == opencv_threads
    assert cv2.getNumThreads() == own


def test_zero_opencv_threads_leave_opencvs_own(
    make_settings: Callable[..., AgentSettings], engine: object
) -> None:
    import cv2

    own = cv2.getNumThreads()
    with Agent(make_settings(opencv_threads=0), engine=engine, publisher=MemoryPublisher()):  # type: ignore[arg-type]
        assert cv2.getNumThreads() == own
