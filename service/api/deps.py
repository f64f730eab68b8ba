"""Dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.state import AppState


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.monitor
    return state


async def _raw_body(request: Request) -> bytes:
    return await request.body()


State = Annotated[AppState, Depends(_state)]
RawBody = Annotated[bytes, Depends(_raw_body)]
