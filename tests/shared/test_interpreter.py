"""switch_interval: the service's interval while it runs, the process's own after."""

from __future__ import annotations

import sys

import pytest

from shared.interpreter import switch_interval


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
