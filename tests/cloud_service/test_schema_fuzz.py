"""Schemathesis against the served OpenAPI document: no generated request gets a 5xx.

A bounded run (a few examples per operation and mode) on SQLite and on PostgreSQL (its
32-bit INTEGER ids overflow where SQLite's do not); ``scripts/fuzz.py --api-cases``
runs the long form.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from simulations.fuzz_api import api_server, fuzz_api

pytest.importorskip("schemathesis")  # the dev extra installs it

pytestmark = [pytest.mark.sql, pytest.mark.slow]


def test_no_generated_request_gets_a_5xx(
    tmp_path: Path, teacher_path: Path, database_url: str
) -> None:
    with api_server(tmp_path, teacher_path, database_url) as server:
        report = fuzz_api(server.url, examples=6)
    print(report.row())
    assert report.operations >= 20, report.row()  # the whole served API was walked
    assert report.cases >= report.operations * 6, report.row()
    assert not report.invalid_operations, report.invalid_operations[:3]
    assert not report.transport_errors, report.transport_errors[:3]
    assert not report.server_errors, report.server_errors[:5]
    # Handlers were reached, not only the schema check: some requests succeeded.
    assert any(code.startswith("2") for code in report.statuses), report.row()
