"""switch_interval and young_collections: the service's setting while it runs, the
process's own after."""

from __future__ import annotations

import gc
import sys

import pytest

from shared.interpreter import switch_interval, young_collections


def test_applied_then_restored(own_switch_interval: float) -> None:
    interval = switch_interval(0.5)
    interval.apply()
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    interval.apply()  # a second apply keeps the process's own interval to go back to
    interval.restore()
    assert sys.getswitchinterval() == pytest.approx(own_switch_interval)
    interval.restore()  # nothing applied: nothing changes
    assert sys.getswitchinterval() == pytest.approx(own_switch_interval)


def test_zero_leaves_the_interval_alone(own_switch_interval: float) -> None:
    with switch_interval(0):
        assert sys.getswitchinterval() == pytest.approx(own_switch_interval)
    assert sys.getswitchinterval() == pytest.approx(own_switch_interval)


def test_as_a_context_manager(own_switch_interval: float) -> None:
    with switch_interval(1.0):
        assert sys.getswitchinterval() == pytest.approx(0.001)
    assert sys.getswitchinterval() == pytest.approx(own_switch_interval)


def test_young_collections_applied_then_restored() -> None:
    own, frozen = gc.get_threshold(), gc.get_freeze_count()
    collections = young_collections(20_000)
    collections.apply()
    try:
        assert gc.get_threshold() == (20_000, *own[1:])
        # What the process held when the service started is out of every collection.
        assert gc.get_freeze_count() > frozen
        collections.apply()  # a second apply keeps the process's own to go back to
    finally:
        collections.restore()
    assert gc.get_threshold() == own
    assert gc.get_freeze_count() == frozen
    collections.restore()  # nothing applied: nothing changes
    assert gc.get_threshold() == own


def test_zero_leaves_the_collector_alone() -> None:
    own, frozen = gc.get_threshold(), gc.get_freeze_count()
    with young_collections(0):
        assert gc.get_threshold() == own
        assert gc.get_freeze_count() == frozen
    assert gc.get_threshold() == own
