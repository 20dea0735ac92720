"""Engines, sessions and migrations, the same on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from shared.errors import StoreError

__all__ = ["make_engine", "make_session_factory", "upgrade_database"]

log = logging.getLogger(__name__)
MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


def _sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets the API read while the verifier writes; busy_timeout makes writers
    # from two processes wait for each other instead of failing at once.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``url``: SQLite gets WAL and a busy timeout, PostgreSQL a pre-ping pool."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False}, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Any:
    """An Alembic Config built in code (no alembic.ini needed at run time)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolates '%'; URL-encoded passwords carry them.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade_database(url: str, revision: str = "heads") -> None:
    """Bring the database at ``url`` to ``revision`` (idempotent); raise StoreError on failure."""
    from alembic import command

    try:
        command.upgrade(alembic_config(url), revision)
    except SQLAlchemyError as exc:
        raise StoreError(f"cannot migrate the database: {exc.__class__.__name__}: {exc}") from exc
