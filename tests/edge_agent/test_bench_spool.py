"""The spool benchmark runs, measures every page size, and marks the spool's own."""

from __future__ import annotations

from bench import spool as bench_spool
from edge_agent.spool import PAGE_SIZE


def test_the_spool_benchmark_measures_each_page_size() -> None:
    result = bench_spool.run(quick=True)
    figures = result["figures"]
    for size in bench_spool.PAGE_SIZES:
        for envelope in bench_spool.ENVELOPE_SIZES:
            row = figures[f"page_{size}_{envelope // 1000}kb"]
            assert row["cpu_us_per_sample"] > 0
            # Each sample's envelope reaches the file at least once.
            assert row["written_kib_per_sample"] * 1024 >= envelope
    # Most transactions hold one or two samples, as the agent's forward path writes them.
    assert 1.0 < figures["samples_per_transaction"] < 2.5
    assert f"| {PAGE_SIZE} |" in result["tables"][0]
