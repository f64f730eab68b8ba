"""Stored times: the clock rows are stamped with, and how answers show a stored time. Imports no SQLAlchemy."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    if moment is None:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def iso_time(moment: datetime | None) -> str | None:
    """A stored time as ISO 8601 / RFC 3339 with its UTC offset, as every answer shows times."""
    value = as_utc(moment)
    return value.isoformat() if value else None
