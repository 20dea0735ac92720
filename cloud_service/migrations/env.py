"""Alembic environment: online migrations only, with the URL from the Config built in code."""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from cloud_service.db.models import Base
from cloud_service.db.session import make_engine

# An arbitrary constant: every cloud process migrating the same PostgreSQL
# database at start takes this advisory lock, so two never race on DDL.
_PG_MIGRATION_LOCK = 7_242_001


def run_migrations_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    assert url is not None, "upgrade_database sets sqlalchemy.url"
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
                connection.commit()
            try:
                context.configure(
                    connection=connection,
                    target_metadata=Base.metadata,
                    render_as_batch=connection.dialect.name == "sqlite",
                )
                with context.begin_transaction():
                    context.run_migrations()
            finally:
                if connection.dialect.name == "postgresql":
                    connection.execute(
                        text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_MIGRATION_LOCK}
                    )
                    connection.commit()
    finally:
        engine.dispose()


run_migrations_online()
