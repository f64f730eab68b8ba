"""Engines, sessions and migrations for SQLite (embedded default) and Postgres (production)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).parent / "migrations"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    cursor = connection.cursor()
    # WAL lets the API read while the worker writes; foreign keys are off by default in SQLite.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def make_sessions(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str, revision: str = "head") -> None:
    """Brings the database at ``url`` to ``revision`` (upgrade or downgrade)."""
    from alembic import command

    config = alembic_config(url)
    current = current_revision(url)
    if revision == "base" or (current is not None and _is_ahead(config, current, revision)):
        command.downgrade(config, revision)
    else:
        command.upgrade(config, revision)


def current_revision(url: str) -> str | None:
    """The schema revision of the database at ``url``; None before the first migration."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def _is_ahead(config: Any, current: str, target: str) -> bool:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(config)
    if target == "head":
        return False
    return target in {rev.revision for rev in script.iterate_revisions(current, "base")} and target != current


def outage(error: BaseException) -> str | None:
    """Why ``error`` means the database is unavailable, or None when it is a fault of the query or its data.

    SQLAlchemy wraps a refused or dropped connection, a statement timeout, SQLite's "database is
    locked" and a deadlock in OperationalError (or InterfaceError); a later try can succeed. Bad
    data comes as DataError, IntegrityError, or a StatementError raised before anything was sent.
    """
    from sqlalchemy import exc

    if isinstance(error, exc.TimeoutError):
        return "timed out: no database connection came free in time"
    if isinstance(error, exc.DBAPIError) and (
        error.connection_invalidated or isinstance(error, exc.OperationalError | exc.InterfaceError)
    ):
        return "unreachable, busy or too slow"
    return None
