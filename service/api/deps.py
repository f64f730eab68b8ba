"""Dependencies shared by the routers."""

from __future__ import annotations

import codecs
from typing import Annotated

from fastapi import Depends, Request

from service.access import Access
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


def _access(request: Request) -> Access:
    """The caller's bearer token, if any; whether one is needed is the Access rules' business.

    Read from the header directly rather than declared as an OpenAPI security scheme: a token is
    needed only under conditions (tokens exist, settings), which OpenAPI cannot state, and a scheme
    declared required would tell clients and schema fuzzers that every call needs one.
    """
    state = _state(request)
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    is_bearer = scheme.lower() == "bearer" and bool(secret.strip())
    return Access(state.tokens, secret.strip() if is_bearer else None, state.settings)


State = Annotated[AppState, Depends(_state)]
RawBody = Annotated[bytes, Depends(_raw_body)]
Caller = Annotated[Access, Depends(_access)]


def _write_run(access: Caller, run: str) -> None:
    access.write(run)


def _write_some_run(access: Caller) -> None:
    access.write(None)


def _read_run(access: Caller, run: str) -> None:
    access.read([run])


def _read_all(access: Caller) -> None:
    access.read(None)


def _read_no_run_data(access: Caller) -> None:
    access.read(())


# Route dependencies, solved before the body is read or validated: a refused caller gets 401/403, not 422.
WritesRun = Depends(_write_run)
WritesSomeRun = Depends(_write_some_run)  # the run's name is in the body; the handler checks it too
ReadsRun = Depends(_read_run)
ReadsAll = Depends(_read_all)
ReadsNoRunData = Depends(_read_no_run_data)
