"""Chaos, short forms: each fault on loopback; nothing lost, duplicated or left unverified.

The full forms (longer outages, several kills, a 5-minute offline agent, a 30-second
PostgreSQL outage) run with ``scripts/chaos.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations.chaos import (
    agent_offline,
    api_restart,
    broker_restart,
    postgres_binaries,
    postgres_restart,
    spool_full,
    verifier_sigkill,
)

pytestmark = [pytest.mark.mqtt, pytest.mark.sql, pytest.mark.slow, pytest.mark.chaos]


def test_broker_restart_mid_stream(folder: Path) -> None:
    outcome = broker_restart(folder, frames_n=120, down_s=1.0)
    print(outcome.row())
    assert outcome.forwarded == 120 and outcome.ok, outcome.row()


def test_verifier_sigkill(folder: Path) -> None:
    outcome = verifier_sigkill(folder, frames_n=120, kills=1)
    print(outcome.row())
    assert outcome.crashed == 1 and outcome.ok, outcome.row()


def test_agent_offline_then_back(folder: Path) -> None:
    outcome = agent_offline(folder, frames_n=40, offline_s=2.0)
    print(outcome.row())
    assert outcome.forwarded == 80 and outcome.ok, outcome.row()


def test_spool_full_evicts_by_policy_and_counts_it(folder: Path) -> None:
    outcome = spool_full(folder, frames_n=200, max_bytes=1 << 16)
    print(outcome.row())
    assert outcome.evicted > 0  # the cap was hit: eviction is the policy, counted
    assert outcome.lost == 0 and outcome.duplicated == 0 and outcome.without_verdict == 0


@pytest.mark.skipif(postgres_binaries() is None, reason="PostgreSQL binaries are not installed")
def test_postgres_restart_mid_stream(folder: Path) -> None:
    outcome = postgres_restart(folder, frames_n=120, down_s=3.0)
    print(outcome.row())
    assert outcome.forwarded == 120 and outcome.ok, outcome.row()
    assert outcome.refused > 0  # the outage was felt: writes were refused and retried


def test_api_restart_under_enroll_poll_upload(folder: Path) -> None:
    outcome = api_restart(folder, frames_n=120, kills=1, down_s=1.0)
    print(outcome.row())
    assert outcome.crashed == 1 and outcome.ok, outcome.row()
    assert outcome.refused > 0  # clients met the outage and retried
