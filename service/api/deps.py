"""Dependencies shared by the routers, and ``AccessFirst``: the route class of routes that take a body."""

from __future__ import annotations

import email.message
import typing
from collections.abc import Callable, Coroutine, Mapping
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from service.access import Access
from service.api.bodies import ParsedRequest, check_body_bytes, checked_text, parse_body
from service.api.state import AppState


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.monitor
    return state


async def _raw_body(request: Request) -> bytes:
    """The body as sent, which ingest stores; it must be UTF-8 JSON (RFC 8259), without a byte order mark."""
    if isinstance(request, ParsedRequest):  # checked while it was parsed
        return request.raw
    raw = await request.body()
    checked_text(raw)
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


def next_page(response: Response, path: str, params: Mapping[str, object]) -> None:
    """Links a full page to the next one (``Link: <path?params>; rel="next"``, RFC 8288); None params left out."""
    query = urlencode({k: v for k, v in params.items() if v is not None})
    response.headers["Link"] = f'<{path}?{query}>; rel="next"'


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
# The checks a body route may declare, each called with the Access and the path parameters it names.
HEADER_CHECKS: tuple[Callable[..., None], ...] = (_write_run, _write_some_run, _read_run, _read_all, _read_no_run_data)


class AccessFirst(APIRoute):
    """A route whose body is read only once its access check passed on the headers, and parsed off the loop.

    FastAPI itself reads and parses a declared body on the event loop before it solves any
    dependency (service.api.bodies says why that matters). A route with a body must declare one
    of ``HEADER_CHECKS`` in ``dependencies``; FastAPI solves it again afterwards, from the token
    cache. Routes without a body are FastAPI's own.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self.endpoint)
        if model is None:
            return handler
        checks = [_with_path_names(d.dependency) for d in self.dependencies if d.dependency in HEADER_CHECKS]
        if not checks:
            raise TypeError(f"{self.path}: a route with a body must declare its access check in dependencies")

        async def access_then_body(request: Request) -> Response:
            await run_in_threadpool(_run_checks, checks, _access(request), request.path_params)
            if not _is_json(request):
                return await handler(request)  # FastAPI refuses it without parsing it, as it always has
            declared = request.headers.get("content-length", "")
            check_body_bytes(int(declared) if declared.isascii() and declared.isdigit() else None, model)
            state = _state(request)
            # Held from before the first byte is read until the answer is built: bodies being read count
            # against the budget too (20 bodies of 31 MB read at once grew the server by 1.2 GB before any
            # of them reached it), and the parsed model lives as long as the handler runs.
            async with state.bodies.hold(_declared_size(request, state.settings.max_body_bytes)):
                raw = await request.body()
                if not raw:
                    return await handler(request)  # a missing body: FastAPI's 422
                check_body_bytes(len(raw), model)  # sent without a length
                parsed = await run_in_threadpool(parse_body, raw, model, state.ingest_limits)
                return await handler(ParsedRequest(request, raw, parsed))

        return access_then_body


def _declared_size(request: Request, max_body_bytes: int) -> int:
    """The body's size as its Content-Length says; ``max_body_bytes`` (its most) when it does not say.

    BodyLimit refuses a body past ``max_body_bytes`` while it is read, whatever it declared.
    """
    declared = request.headers.get("content-length", "")
    return min(int(declared), max_body_bytes) if declared.isascii() and declared.isdigit() else max_body_bytes


HeaderCheck = tuple[Callable[..., None], tuple[str, ...]]  # an access check and the path parameters it takes


def _with_path_names(check: Callable[..., None]) -> HeaderCheck:
    return check, tuple(name for name in typing.get_type_hints(check) if name not in ("access", "return"))


def _run_checks(checks: list[HeaderCheck], access: Access, path: Mapping[str, Any]) -> None:
    for check, names in checks:
        check(access, **{name: path[name] for name in names})


def _body_model(endpoint: Callable[..., Any]) -> type[BaseModel] | None:
    """The endpoint's body: its one parameter typed as a pydantic model (Annotated or not)."""
    found = []
    for name, hint in typing.get_type_hints(endpoint, include_extras=True).items():
        kind = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint
        if name != "return" and isinstance(kind, type) and issubclass(kind, BaseModel):
            found.append(kind)
    if len(found) > 1:
        raise TypeError(f"{endpoint.__name__}: one body model per route, got {found}")
    return found[0] if found else None


def _is_json(request: Request) -> bool:
    """Whether FastAPI reads the body as JSON: a JSON content type (``application/json``, ``*+json``)."""
    content_type = request.headers.get("content-type")
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
