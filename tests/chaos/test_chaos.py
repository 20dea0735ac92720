"""Chaos, short forms: each fault on loopback; nothing lost, duplicated or left unverified.

The full forms (longer outages, several kills, a 5-minute offline agent, a PostgreSQL
restart) run with ``scripts/chaos.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.harness import Rig, agent_offline, broker_restart, spool_full, verifier_sigkill

pytestmark = [pytest.mark.mqtt, pytest.mark.sql, pytest.mark.slow]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    made = Rig(tmp_path)
    try:
        yield made
    finally:
        made.close()


def test_broker_restart_mid_stream(rig: Rig) -> None:
    outcome = broker_restart(rig, frames_n=120, down_s=1.0)
    print(outcome.row())
    assert outcome.forwarded == 120 and outcome.ok, outcome.row()


def test_verifier_sigkill(rig: Rig) -> None:
    outcome = verifier_sigkill(rig, frames_n=120, kills=1)
    print(outcome.row())
    assert outcome.crashed == 1 and outcome.ok, outcome.row()


def test_agent_offline_then_back(rig: Rig) -> None:
    outcome = agent_offline(rig, frames_n=40, offline_s=2.0)
    print(outcome.row())
    assert outcome.forwarded == 80 and outcome.ok, outcome.row()


def test_spool_full_evicts_by_policy_and_counts_it(rig: Rig) -> None:
    outcome = spool_full(rig, frames_n=200, max_bytes=1 << 16)
    print(outcome.row())
    assert outcome.evicted > 0  # the cap was hit: eviction is the policy, counted
    assert outcome.lost == 0 and outcome.duplicated == 0 and outcome.without_verdict == 0
