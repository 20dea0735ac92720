"""The array literals the multi-row PostgreSQL inserts send: every value reads back as sent."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from cloud_service.db.crud.ingest import _array_literal

on_postgres = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)

HOSTILE_TEXT = [
    "",
    "NULL",
    "null",
    'a "quoted" word',
    "back\\slash\\",
    "\\",
    '"',
    "{braces},commas",
    "  spaces kept  ",
    "ünïcödé ✓",
    '{"json": ["a", "b\\"c"]}',
    "new\nline\ttab",
    None,
]


def _read_back(database_url: str, values: list[Any], kind: str) -> list[Any]:
    literal = _array_literal(values)
    assert isinstance(literal, str)
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return list(
                conn.scalars(text(f"SELECT unnest(CAST(:values AS {kind}[]))"), {"values": literal})
            )
    finally:
        engine.dispose()


@on_postgres
def test_text_reads_back_exactly(database_url: str) -> None:
    assert _read_back(database_url, HOSTILE_TEXT, "TEXT") == HOSTILE_TEXT
    # Without a NULL, a column of text is joined in one pass: the same values come back.
    without_null = [value for value in HOSTILE_TEXT if value is not None]
    assert _read_back(database_url, without_null, "TEXT") == without_null
    plain = ["cam-1", "", "NULL", "a b"]
    assert _read_back(database_url, plain, "TEXT") == plain


def test_one_pass_and_per_value_literals_are_the_same() -> None:
    from cloud_service.db.crud.ingest import _mixed_array_literal

    stamp = datetime(2026, 12, 6, 12, 0, 0, 123456, tzinfo=UTC)
    for column in (
        [value for value in HOSTILE_TEXT if value is not None],
        [0.0, -0.0, 1.5, 1e-300, math.inf, -math.inf, math.nan],
        [0, -1, 2**62],
        [True, False],
        [stamp, stamp + timedelta(seconds=1)],
        [],
    ):
        assert _array_literal(column) == _mixed_array_literal(column), column


@on_postgres
def test_numbers_and_booleans_read_back(database_url: str) -> None:
    floats = [0.0, -0.0, 1.5, 1e-300, 1.7976931348623157e308, 0.1 + 0.2, None]
    assert _read_back(database_url, floats, "DOUBLE PRECISION") == floats
    assert _read_back(database_url, floats[:-1], "DOUBLE PRECISION") == floats[:-1]
    special = _read_back(database_url, [math.inf, -math.inf, math.nan], "DOUBLE PRECISION")
    assert special[:2] == [math.inf, -math.inf] and math.isnan(special[2])
    ints = [0, -1, 2**62, None]
    assert _read_back(database_url, ints, "BIGINT") == ints
    assert _read_back(database_url, [True, False, None], "BOOLEAN") == [True, False, None]
    assert _read_back(database_url, [7, 0], "BIGINT") == [7, 0]
    assert _read_back(database_url, [False, True], "BOOLEAN") == [False, True]
    nonfinite = _read_back(database_url, [1.0, math.inf, math.nan], "DOUBLE PRECISION")
    assert nonfinite[:2] == [1.0, math.inf] and math.isnan(nonfinite[2])


@on_postgres
def test_timestamps_read_back_as_the_same_instant(database_url: str) -> None:
    stamps = [
        datetime(2026, 12, 6, 12, 0, 0, 123456, tzinfo=UTC),
        datetime(2026, 1, 1, 1, 2, 3, tzinfo=timezone(timedelta(hours=5, minutes=30))),
        None,
    ]
    assert _read_back(database_url, stamps, "TIMESTAMPTZ") == stamps
    assert _read_back(database_url, stamps[:-1], "TIMESTAMPTZ") == stamps[:-1]


def test_a_value_of_another_type_leaves_the_list_to_psycopg() -> None:
    values = [uuid.uuid4(), "x"]
    assert _array_literal(values) is values
