"""The migrations build the schema the models describe, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

import cloud_service.jobs.tables  # noqa: F401  (the job tables live on the same metadata)
from cloud_service.db.models import Base
from cloud_service.db.session import make_engine, upgrade_database


def _differences(url: str) -> list[Any]:
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"compare_type": False, "compare_server_default": False}
            )
            return [
                d
                for d in compare_metadata(context, Base.metadata)
                # Index and constraint naming differs by dialect; columns and tables must not.
                if d[0] in ("add_table", "remove_table", "add_column", "remove_column")
            ]
    finally:
        engine.dispose()


def test_upgrade_to_head_matches_the_models(database_url: str) -> None:
    upgrade_database(database_url)
    assert _differences(database_url) == []
    engine = make_engine(database_url)
    try:
        columns = {c["name"]: c for c in inspect(engine).get_columns("samples")}
        assert columns["edge_boxes"]["nullable"]  # 0008: a classifier's rows leave it NULL
    finally:
        engine.dispose()


def test_0008_upgrades_a_database_with_rows_and_downgrades(database_url: str) -> None:
    from alembic import command

    from cloud_service.db.session import alembic_config

    upgrade_database(database_url, "0007_announcement_sequences")
    upgrade_database(database_url)
    config = alembic_config(database_url)
    command.downgrade(config, "0007_announcement_sequences")
    engine = make_engine(database_url)
    try:
        assert "edge_boxes" not in {c["name"] for c in inspect(engine).get_columns("samples")}
    finally:
        engine.dispose()
    upgrade_database(database_url)
    assert _differences(database_url) == []


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
