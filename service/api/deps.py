"""Dependencies shared by the routers."""

from __future__ import annotations

import codecs
from typing import Annotated

from fastapi import Depends, Request

from service.errors import InvalidRequest
from service.state import AppState


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.monitor
    return state


async def _raw_body(request: Request) -> bytes:
    """The body as sent, which ingest stores; it must be UTF-8 JSON (RFC 8259), without a byte order mark."""
    raw = await request.body()
    if raw.startswith(codecs.BOM_UTF8):
        raise InvalidRequest("the body starts with a UTF-8 byte order mark; send the JSON without it", field="body")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the body must be UTF-8 JSON; byte {e.start} is not UTF-8", field="body") from e
    return raw


State = Annotated[AppState, Depends(_state)]
RawBody = Annotated[bytes, Depends(_raw_body)]
