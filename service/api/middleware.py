"""ASGI middleware: what every request goes through before (and after) the handlers.

Refusals made here (a NUL in the URL, a body over the size limit, a client over its rate) answer in
the documented error shape and are counted like the handlers' own.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import uuid
from collections.abc import MutableMapping
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import InvalidRequest, MonitorError, TooLarge, TooManyRequests
from service.rate_limit import TokenBuckets

log = logging.getLogger("collapse_monitor.api")


class AnswerErrors:
    """Answers any exception the handlers let through with a JSON 500 in the documented shape.

    Starlette's own last resort answers plain text and re-raises, and the server then drops the
    keep-alive connection; here the exception ends with this request. The traceback is logged
    under an id that the answer names.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("error %s answering %s %s", error_id, scope["method"], scope["path"])
            if started:  # half an answer is out: only dropping the connection tells the client
                raise
            detail = f"the server failed to answer this request (error {error_id}, logged with its traceback)"
            await JSONResponse(MonitorError(detail).body(), status_code=500)(scope, _drain, send)


# HTTP methods counted under their own name; any other (a client may send any token as a method)
# counts as OTHER, so that made-up methods cannot add series to /metrics.
COUNTED_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in COUNTED_METHODS else "OTHER"


class CountRequests:
    """Counts answered requests by method, route template and status (plain ASGI: no body copies).

    Every label is bounded: methods outside ``COUNTED_METHODS`` are OTHER, paths are route
    templates (an unmatched path is ``unmatched``), statuses are HTTP's.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = "500"

        async def capture(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            state = getattr(getattr(scope.get("app"), "state", None), "monitor", None)
            if state is not None:
                template = getattr(scope.get("route"), "path", "unmatched")
                state.metrics.requests.labels(method_label(scope["method"]), template, status).inc()


class NoNulInUrl:
    """Refuses a NUL character in the path or query (400): no database stores one in a name."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for part, raw in (
                ("path", scope.get("raw_path") or scope["path"].encode()),
                ("query", scope["query_string"]),
            ):
                if b"\x00" in raw or b"%00" in raw:
                    await refuse(
                        scope, send, InvalidRequest(f"the {part} must not contain a NUL character (%00)", field=part)
                    )
                    return
        await self.app(scope, receive, send)


async def refuse(scope: Scope, send: Send, error: MonitorError, reason: str | None = None) -> None:
    """Answers ``error`` before the app's handlers run, counted under ``reason`` (default: its code)."""
    state = getattr(getattr(scope.get("app"), "state", None), "monitor", None)
    if state is not None:
        state.metrics.rejections.labels(reason or error.code).inc()
    await JSONResponse(error.body(), status_code=error.status, headers=error.headers())(scope, _drain, send)


class BodyLimit:
    """Refuses bodies over the limit with 413 before they are read whole, declared length or not."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, send, int(declared))
            return
        seen = 0

        async def counted() -> MutableMapping[str, Any]:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge(self.limit, seen)
            return message

        await self.app(scope, counted, send)

    async def _refuse(self, scope: Scope, send: Send, size: int) -> None:
        error = TooLarge(f"request bodies may hold at most {self.limit} bytes, got {size}")
        await refuse(scope, send, error, "body_too_large")


class BodyTooLarge(HTTPException):
    """Raised while a body without a declared length is read, once it passes the limit."""

    def __init__(self, limit: int, size: int) -> None:
        super().__init__(
            status_code=413, detail=f"request bodies may hold at most {limit} bytes, got more than {size - 1}"
        )


async def _drain() -> MutableMapping[str, Any]:
    return {"type": "http.disconnect"}


# Probes are never limited: they cost nothing (/readyz checks the database one probe at a time),
# and an orchestrator takes a refused probe for a dead service and restarts it, so the flood wins.
UNLIMITED_PATHS = frozenset({"/healthz", "/readyz"})
# Prometheus scrapes draw on a bucket of their own per client: a busy trainer on the scraper's
# host cannot make a scrape fail, and a flood of /metrics is still refused like any other flood.
SCRAPE_PATH = "/metrics"


class RateLimit:
    """429 + Retry-After for a client over ``rate`` requests per second (bursts up to ``burst``), on every path.

    A client is its bearer token once that token is known as one this service issued, else its
    address: made-up tokens share their sender's bucket, so they cannot buy a fresh burst each.
    Every path counts (unmatched ones, pages and static files too) except ``UNLIMITED_PATHS``;
    ``/metrics`` counts in a bucket of its own per client.
    """

    def __init__(self, app: ASGIApp, rate: float, burst: int) -> None:
        self.app = app
        self.buckets = TokenBuckets(rate, burst)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in UNLIMITED_PATHS:
            key = _client(scope)
            if scope["path"] == SCRAPE_PATH:
                key = "scrape:" + key
            wait = self.buckets.take(key, time.monotonic())
            if wait > 0:
                error = TooManyRequests(
                    f"this client sent more than {self.buckets.rate:g} requests per second "
                    f"(bursts of {self.buckets.burst}); retry after the Retry-After header",
                    retry_after=math.ceil(wait),
                )
                await refuse(scope, send, error)
                return
        await self.app(scope, receive, send)


def _client(scope: Scope) -> str:
    scheme, _, secret = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1").partition(" ")
    state = getattr(getattr(scope.get("app"), "state", None), "monitor", None)
    if scheme.lower() == "bearer" and state is not None and state.tokens.known(secret.strip()):
        # The secret itself is never kept, only a digest of it.
        return "token:" + hashlib.sha256(secret.strip().encode()).hexdigest()[:16]
    client = scope.get("client")
    return f"address:{client[0] if client else 'unknown'}"
