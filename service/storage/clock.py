"""The database's clock as a SQL expression (``db_time``): what leases and delivery times are compared by.

Must not import fastapi.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Float, literal
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement


class db_time(FunctionElement[datetime]):
    """The database's clock plus ``seconds``, as a SQL expression: what every lease is timed by.

    Leases are written by one host and compared by another (each worker, each API process): their
    clocks may differ by seconds, which would end a lease early or hold a dead worker's batch late.
    The database's clock is the one every host shares. Postgres: ``now()``, the start of the
    transaction. SQLite: ``strftime('%f')`` (milliseconds), written as SQLAlchemy writes a
    datetime there (UTC, six fraction digits), so the stored texts compare in time order.
    """

    type = DateTime(timezone=True)
    inherit_cache = True

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__(literal(float(seconds), Float()))


@compiles(db_time, "postgresql")
def _db_time_postgresql(element: db_time, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return f"(now() + make_interval(secs => CAST({seconds} AS double precision)))"


@compiles(db_time, "sqlite")
def _db_time_sqlite(element: db_time, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = compiler.process(element.clauses, **kw)
    return f"(strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', {seconds})) || '000')"
