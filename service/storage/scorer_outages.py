"""The scorers a worker found down (``scorer_outages``): written by the worker's circuit breaker, read by
/readyz and /metrics in any process. Plain functions of a Session; callers own the transaction. Must not
import fastapi.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, delete, select
from sqlalchemy.orm import Session

from service.storage.database import dialect_insert
from service.storage.tables import ScorerOutage, utcnow


def note_down(session: Session, name: str, since: datetime, error: str) -> None:
    """Records (or refreshes) that scorer ``name`` is down since ``since`` with ``error``, its last error.

    An upsert that keeps the first ``since``: workers finding the same outage at once must not collide.
    """
    now = utcnow()
    values = {"name": name, "since": since, "error": error, "checked_at": now}
    statement = dialect_insert(session, ScorerOutage).values(values)
    session.execute(statement.on_conflict_do_update(index_elements=["name"], set_={"error": error, "checked_at": now}))


def note_up(session: Session, name: str) -> None:
    """Scorer ``name`` answers again."""
    session.execute(delete(ScorerOutage).where(ScorerOutage.name == name))


def scorers_down(session: Session | Connection) -> dict[str, tuple[datetime, str]]:
    """name -> (down since, last error), for every scorer a worker last found down."""
    query = select(ScorerOutage.name, ScorerOutage.since, ScorerOutage.error).order_by(ScorerOutage.name)
    return {name: (since, error) for name, since, error in session.execute(query)}
