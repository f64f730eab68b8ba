"""Request bodies: access decided from the headers first, then the bytes read, then parsed off the event loop.

FastAPI reads and ``json.loads`` a declared body on the event loop before it solves a route's
dependencies, so an anonymous 32 MB body cost the loop (and every other client) its parse
before its 401, and a malformed one got a 422 instead. ``service.api.deps.AccessFirst`` routes
keep their declared bodies (the OpenAPI document is FastAPI's own) but wrap FastAPI's handler:

1. the route's access dependencies run on the headers alone (401/403 before a byte is read);
2. the body is read, and a ``service.api.rate_limit.BodyBudget`` share is held while it is parsed, so that
   concurrent large bodies cannot multiply the memory parsing needs;
3. in the thread pool: the UTF-8 checks, ``json.loads`` and the model's validation, with the
   errors FastAPI itself gives (same 422 locations and messages, since it is the same parse);
4. FastAPI's handler then finds the parsed model in place of the JSON (``ParsedRequest``); its
   own validation of a model instance returns it as is.

A request holds about 6x a token-id body's size at its peak (``shared_ints``; docs/security.md
gives the measurement), and its ``BodyBudget`` share until its answer is built.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from service.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)
MAX_SHARED_INTS = 1 << 18  # distinct numbers one body shares: every vocabulary we know has fewer tokens


def shared_ints() -> Callable[[str], int]:
    """A ``parse_int`` for one ``json.loads``: one int object per distinct number of the body, not one per occurrence.

    A token id parsed as its own int costs 28 bytes plus its list slot, ~6x its ~6 bytes of JSON;
    a body's ids come from one vocabulary, so sharing them cuts a request's peak from ~12x to ~6x
    its body (the values are the same ints). It is Python on purpose: the C parser alone holds the
    GIL for a whole body (~1 s for 30 MB, during which no other request was answered), while a
    Python call per number lets the event loop's thread in; the parse takes ~2x longer for it. At
    most ``MAX_SHARED_INTS`` are kept, so a body of all-distinct numbers costs no more than usual.
    """
    kept: dict[str, int] = {}

    def parse_int(number: str) -> int:
        value = kept.get(number)
        if value is None:
            value = int(number)
            if len(kept) < MAX_SHARED_INTS:
                kept[number] = value
        return value

    return parse_int


def checked_text(raw: bytes) -> str:
    """The body as text; it must be UTF-8 JSON (RFC 8259), without a byte order mark (400 otherwise)."""
    if raw.startswith(codecs.BOM_UTF8):
        raise InvalidRequest("the body starts with a UTF-8 byte order mark; send the JSON without it", field="body")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"the body must be UTF-8 JSON; byte {e.start} is not UTF-8", field="body") from e


def parse_body(raw: bytes, model: type[M]) -> M:
    """``raw`` validated as ``model``, refused as FastAPI refuses a declared body (locations under ``body``).

    Runs in the thread pool. The text is dropped once parsed, so that it and the parsed objects
    and their validated copy are not all held at once.
    """
    text = checked_text(raw)
    try:
        data = json.loads(text, parse_int=shared_ints())
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": e.msg}}]) from e
    except (RecursionError, ValueError) as e:  # nested too deep, a number of over 4300 digits: FastAPI's 400
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
    del text
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**d, "loc": ("body", *d["loc"])} for d in e.errors(include_url=False)]) from e


class ParsedRequest(Request):
    """The request as FastAPI's handler then sees it: the bytes already read, the JSON already the model."""

    def __init__(self, request: Request, raw: bytes, parsed: BaseModel) -> None:
        super().__init__(request.scope, request.receive)
        self.raw = raw
        self.parsed = parsed

    async def body(self) -> bytes:
        return self.raw

    async def json(self) -> Any:
        return self.parsed
