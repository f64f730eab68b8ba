"""Engines, sessions and migrations for SQLite (embedded default) and Postgres (production).

Also what counts as a database outage (``outage``): the errors that mean "unreachable, timed out
or disconnected" rather than a fault of one query. Must not import fastapi.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).parent / "migrations"


def make_engine(
    url: str, *, connect_timeout_seconds: int | None = None, statement_timeout_seconds: float | None = None
) -> Engine:
    """An engine whose every wait on the database is bounded (None: unbounded, for migrations).

    Postgres: ``connect_timeout_seconds`` bounds a connection attempt (and a wait for a free pooled
    connection), ``statement_timeout_seconds`` one statement on the server and, a second later, any
    wait for the server's answer in the client (a hung server cancels nothing). SQLite: the
    statement timeout is the wait for another writer's lock (busy timeout).
    """
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        busy = statement_timeout_seconds if statement_timeout_seconds is not None else 30.0
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": busy})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    connect_args: dict[str, Any] = {}
    if connect_timeout_seconds is not None:
        connect_args["connect_timeout"] = connect_timeout_seconds
    if statement_timeout_seconds is not None:
        connect_args["options"] = f"-c statement_timeout={round(statement_timeout_seconds * 1000)}"
    engine = create_engine(
        url,
        # A pooled connection is checked before use, so one left dead by an outage is replaced at once.
        pool_pre_ping=True,
        pool_size=10,
        max_overflow=20,
        pool_timeout=connect_timeout_seconds if connect_timeout_seconds is not None else 30,
        connect_args=connect_args,
    )
    if statement_timeout_seconds is not None and engine.dialect.driver == "psycopg":
        # The server's statement_timeout does not fire while the server is frozen (SIGSTOP, a hung
        # host): its kernel still acknowledges what we send. Only the client can stop waiting.
        answer = statement_timeout_seconds + 1
        event.listen(engine, "do_connect", partial(_connect_answering_within, seconds=answer))
        # The pool's ping ("SELECT 1" before reuse) gets the connect timeout, not a statement's.
        ping = float(connect_timeout_seconds) if connect_timeout_seconds is not None else answer
        event.listen(engine.pool, "checkin", partial(_answer_within, seconds=ping))
        event.listen(engine.pool, "checkout", partial(_answer_within, seconds=answer))
    return engine


class NoAnswer(psycopg.OperationalError):
    """The server did not answer within the client's deadline (the connection is closed)."""


class _AnsweringWithin(psycopg.Connection[Any]):
    """A psycopg connection that gives up on the server after ``answer_seconds`` of any one wait.

    Every query, fetch, commit, rollback and the pool's ping waits in ``wait``. A wait that runs
    out leaves the protocol mid-message, so the connection is closed: SQLAlchemy then sees a
    disconnect, discards it and checks the rest of the pool before reuse.
    """

    answer_seconds: float | None = None

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        try:
            return super().wait(gen, interval, timeout if timeout is not None else self.answer_seconds)
        except psycopg.errors._WaitTimeout as e:  # psycopg's own name for it is private
            self.close()
            raise NoAnswer(f"the database did not answer within {self.answer_seconds:g} s") from e


def _connect_answering_within(
    _dialect: Any, _record: Any, cargs: list[Any], cparams: dict[str, Any], *, seconds: float
) -> psycopg.Connection[Any]:
    connection = _AnsweringWithin.connect(*cargs, **cparams)
    connection.answer_seconds = seconds
    return connection


def _answer_within(dbapi_connection: Any, *_: Any, seconds: float) -> None:
    if isinstance(dbapi_connection, _AnsweringWithin):  # None when the pool discarded it
        dbapi_connection.answer_seconds = seconds


STORAGE_FULL = "storage full: the database's disk has no space left for writes"


def outage(error: BaseException) -> str | None:
    """Why ``error`` means the database is unavailable, or None when it is a fault of the query.

    Unavailable: refused or dropped connections, connect and statement timeouts, no pooled
    connection free in time, a locked SQLite file, the server shutting down, a full disk
    (``STORAGE_FULL``, which the API answers 507). A retry later can succeed, so the API answers
    503 and the background loops back off and try again.
    """
    if isinstance(error, exc.TimeoutError):
        return "timed out: no database connection came free in time"
    if not isinstance(error, exc.DBAPIError):
        return None
    cause = error.orig
    # SQLite's "database or disk is full" (also past max_page_count); Postgres's disk_full, SQLSTATE 53100.
    if getattr(cause, "sqlite_errorname", None) == "SQLITE_FULL" or isinstance(cause, psycopg.errors.DiskFull):
        return STORAGE_FULL
    if isinstance(cause, psycopg.errors.QueryCanceled | psycopg.errors.ConnectionTimeout | NoAnswer):
        return "timed out: the database did not answer in time"
    if getattr(cause, "sqlite_errorname", None) in ("SQLITE_BUSY", "SQLITE_LOCKED"):
        return "timed out: another writer held the database too long"
    if error.connection_invalidated or isinstance(error, exc.OperationalError | exc.InterfaceError):
        return "unreachable: the database refused or dropped the connection"
    return None


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    cursor = connection.cursor()
    # WAL lets the API read while the worker writes; foreign keys are off by default in SQLite.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def dialect_insert(session: Session, table: Any) -> postgresql.Insert | sqlite.Insert:
    """An INSERT into ``table`` in the session's dialect: both spell ``on_conflict_do_*`` (upserts) alike."""
    return postgresql.insert(table) if session.get_bind().dialect.name == "postgresql" else sqlite.insert(table)


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


def first_line(error: BaseException) -> str:
    """An error's message in one line (driver messages run over several), for one-line logs."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def head_revision(url: str) -> str | None:
    """The schema revision this code needs (the newest migration)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()
