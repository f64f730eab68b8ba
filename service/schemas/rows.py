"""Stored rows into answers: one validation call per row, stored times as ISO 8601 strings."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
)

from service.storage.times import iso_time

# Rows into answers ------------------------------------------------------------------------------


def _iso(value: object) -> object:
    return iso_time(value) if isinstance(value, datetime) else value


# A stored time as the answers show it (``iso_time``): ISO 8601 with its UTC offset; a string schema.
IsoTime = Annotated[str, BeforeValidator(_iso)]

Model = TypeVar("Model", bound=BaseModel)


class _Row:
    """A row's attributes with some replaced or added: what an answer shows that the row does not hold."""

    def __init__(self, row: object, extra: dict[str, object]) -> None:
        self._row, self._extra = row, extra

    def __getattr__(self, name: str) -> object:
        return self._extra[name] if name in self._extra else getattr(self._row, name)


def from_row(model: type[Model], row: object, **extra: object) -> Model:
    """``model`` validated from an ORM row's attributes in one call; ``extra`` names what the row lacks."""
    return model.model_validate(_Row(row, extra) if extra else row, from_attributes=True)
