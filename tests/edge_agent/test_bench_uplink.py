"""The uplink benchmark runs against the local broker and reports both clients."""

from __future__ import annotations

import pytest

from bench import uplink as bench_uplink

pytestmark = [pytest.mark.mqtt]


def test_the_uplink_benchmark_times_the_link_and_plain_paho(broker: object) -> None:
    result = bench_uplink.run(quick=True, broker=broker.url)  # type: ignore[attr-defined]
    figures = result["figures"]
    if "skipped" in figures:
        pytest.skip(figures["skipped"])
    for client in ("link", "paho"):
        assert 0 < figures[f"{client}_p50_ms"] <= figures[f"{client}_p99_ms"]
    assert "agent's MqttLink" in result["tables"][0]
