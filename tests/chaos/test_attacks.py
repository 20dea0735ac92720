"""Attacks, short forms: each hostile input refused, nothing legitimate lost.

The full forms (more bombs, more junk, 200 slow connections, 4 x 200 MB bodies) run
with ``scripts/chaos.py --attacks``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations import attacks

pytestmark = [pytest.mark.mqtt, pytest.mark.sql, pytest.mark.slow, pytest.mark.chaos]


def test_jpeg_bombs_are_refused_while_an_agent_streams(folder: Path) -> None:
    outcome = attacks.scan_bombs(folder, bombs=2, frames_n=40)
    print(outcome.row())
    assert outcome.refused == 2 and outcome.ok, outcome.row()


def test_junk_on_an_agents_topic_does_not_cost_it_its_samples(folder: Path) -> None:
    outcome = attacks.junk_on_agent_topic(folder, junk=40, frames_n=40)
    print(outcome.row())
    assert outcome.legit_sent == 40 and outcome.ok, outcome.row()


def test_a_reused_sample_id_from_another_agent_is_stored(folder: Path) -> None:
    outcome = attacks.sample_id_collision(folder, n=10)
    print(outcome.row())
    assert outcome.tried == 10 and outcome.ok, outcome.row()


def test_unauthenticated_bodies_are_refused_before_they_are_read(folder: Path) -> None:
    outcome = attacks.oversized_bodies(folder, mb=64, parallel=2)
    print(outcome.row())
    assert outcome.refused == outcome.tried == 4 and outcome.ok, outcome.row()
    assert outcome.rss_growth_mb < 64, outcome.row()


def test_slow_request_heads_are_cut_off(folder: Path) -> None:
    outcome = attacks.slow_headers(folder, connections=20, header_timeout_s=0.5)
    print(outcome.row())
    assert outcome.refused == 20 and outcome.ok, outcome.row()


def test_nul_and_overflow_inputs_answer_4xx(folder: Path) -> None:
    outcome = attacks.nul_inputs(folder)
    print(outcome.row())
    assert outcome.tried == outcome.refused and outcome.ok, outcome.row()
