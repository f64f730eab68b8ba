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
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.rate_limit import TokenBuckets
from service.errors import ForeignOrigin, InvalidRequest, MonitorError, TooLarge, TooManyRequests, UntrustedHost

log = logging.getLogger("collapse_monitor.api")


class HttpOnly:
    """A plain-ASGI middleware whose ``handle`` sees HTTP requests only; other scopes (lifespan) pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class AnswerErrors(HttpOnly):
    """Answers any exception the handlers let through with a JSON 500 in the documented shape.

    Starlette's own last resort answers plain text and re-raises, and the server then drops the
    keep-alive connection; here the exception ends with this request. The traceback is logged
    under an id that the answer names.
    """

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watch(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:  # the client left (or was closed for its slowness) mid-body: no one to answer
            log.info("%s %s: the client disconnected before its body was in", scope["method"], scope["path"])
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


class CountRequests(HttpOnly):
    """Counts answered requests by method, route template and status (plain ASGI: no body copies).

    Every label is bounded: methods outside ``COUNTED_METHODS`` are OTHER, paths are route
    templates (an unmatched path is ``unmatched``), statuses are HTTP's.
    """

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
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


# Headers a request may send once: access and the rate limiter must read the same token, the host check the
# same name (a duplicate was read first-wins by one and last-wins by the other).
SINGLE_HEADERS = (b"authorization", b"host")


class OneOfEachHeader:
    """Refuses a request that repeats a header of ``SINGLE_HEADERS`` (400 naming it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = [name for name, _ in scope.get("headers", []) if name in SINGLE_HEADERS]
            for name in SINGLE_HEADERS:
                if names.count(name) > 1:
                    header = name.decode().title()
                    detail = f"the {header} header must be sent once, got {names.count(name)}"
                    await refuse(scope, send, InvalidRequest(detail, field=header))
                    return
        await self.app(scope, receive, send)


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


class BodyLimit(HttpOnly):
    """Refuses bodies over the limit with 413 before they are read whole, declared length or not."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        super().__init__(app)
        self.limit = limit

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        detail = f"request bodies may hold at most {self.limit} bytes, got {size}"
        error = TooLarge(detail, limit="max_body_bytes", allowed=self.limit, got=size)
        await refuse(scope, send, error, "body_too_large")


class BodyTooLarge(HTTPException):
    """Raised while a body without a declared length is read, once it passes the limit."""

    def __init__(self, limit: int, size: int) -> None:
        super().__init__(
            status_code=413, detail=f"request bodies may hold at most {limit} bytes, got more than {size - 1}"
        )
        self.limits = {"limit": "max_body_bytes", "allowed": limit, "got": size}  # as TooLarge words them


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


def _header(scope: Scope, name: bytes) -> str | None:
    value = dict(scope.get("headers", [])).get(name)
    return value.decode("latin-1") if value is not None else None


def split_host(host: str) -> tuple[str, str | None]:
    """A Host header (or an origin's host) as name and port: ``[::1]:8000`` -> ``("[::1]", "8000")``.

    Only digits make a port: ``localhost:1@evil.example`` is one (unknown) name, not ``localhost``.
    """
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]") + 1
        if not end:
            return host, None
        name, rest = host[:end], host[end:]
    else:
        name, colon, port = host.partition(":")
        rest = colon + port
    if not rest:
        return name, None
    port = rest[1:]
    return (name, port) if rest.startswith(":") and port.isascii() and port.isdigit() else (host, None)


def host_name(host: str) -> str:
    """The name of a Host header (``[::1]:8000`` -> ``[::1]``, ``Example.org:80`` -> ``example.org``)."""
    return split_host(host)[0]


# Probes answer any Host: they reveal nothing, and an orchestrator probes by address.
HOST_FREE_PATHS = frozenset({"/healthz", "/readyz"})


class TrustedHosts:
    """Refuses a Host header the service does not answer to (400 untrusted_host), as Starlette's
    TrustedHostMiddleware does, in the documented error shape and counted.

    A page on another origin that rebinds its DNS name to this machine's address reaches the
    service under its own name: refused here, before any read or write. Patterns: a name,
    ``*.example.com`` (its subdomains) or ``*`` (any).
    """

    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app = app
        self.exact = {p for p in allowed if not p.startswith("*")}
        self.suffixes = tuple(p[1:] for p in allowed if p.startswith("*."))
        self.allow_any = "*" in allowed

    def allows(self, host: str) -> bool:
        name = host_name(host)
        return self.allow_any or name in self.exact or name.endswith(self.suffixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.allow_any and scope["path"] not in HOST_FREE_PATHS:
            host = _header(scope, b"host") or ""
            if not self.allows(host):
                error = UntrustedHost(
                    f"this service does not answer to the host {host_name(host)[:200]!r}; an operator lists the "
                    "names clients use in allowed_hosts",
                    field="Host",
                )
                await refuse(scope, send, error)
                return
        await self.app(scope, receive, send)


STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DEFAULT_PORTS = {"http": "80", "https": "443"}


def is_same_origin(origin: str, host: str) -> bool:
    """Whether a page of ``origin`` (``scheme://host[:port]``) sent a request to the ``host`` it names.

    A port left out is its scheme's default on both sides: behind a TLS proxy, the page of
    ``https://monitor.example.org`` sends ``Host: monitor.example.org``.
    """
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or scheme not in DEFAULT_PORTS or not rest or "/" in rest:
        return False  # "null" (sandboxed frames, files) and anything unreadable
    (origin_name, origin_port), (host_name_, host_port) = split_host(rest), split_host(host)
    default = DEFAULT_PORTS[scheme]
    return origin_name == host_name_ and (origin_port or default) == (host_port or default)


class SameOrigin:
    """Refuses POST, PUT, PATCH and DELETE sent by a browser page of another origin (403 foreign_origin).

    Browsers send ``Origin`` with every such request; a page of another site (or of a rebound
    name) that tries to write or delete through a visitor's browser is refused, whatever the
    access mode. Same origin: ``is_same_origin``; ``allowed_origins`` adds others. No Origin
    header: not a browser, not refused here.
    """

    def __init__(self, app: ASGIApp, allowed_origins: list[str]) -> None:
        self.app = app
        self.allowed = {o.strip().lower().rstrip("/") for o in allowed_origins}

    def allows(self, origin: str, host: str) -> bool:
        return origin.strip().lower().rstrip("/") in self.allowed or is_same_origin(origin, host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in STATE_CHANGING:
            origin = _header(scope, b"origin")
            if origin is not None and not self.allows(origin, _header(scope, b"host") or ""):
                error = ForeignOrigin(
                    f"{scope['method']} from a page of another origin ({origin[:200]!r}) is refused; an operator "
                    "lists the origins allowed to write in allowed_origins"
                )
                await refuse(scope, send, error)
                return
        await self.app(scope, receive, send)


# The pages load only their own scripts and styles (no inline script, no CDN); style attributes
# are allowed because the pages and their chart library position elements with them.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),  # frame-ancestors for browsers that predate it
]


class SecurityHeaders(HttpOnly):
    """Adds the browser-facing headers to every answer: the pages' CSP (no framing), nosniff, no referrer."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:

        async def with_headers(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(name, value) for name, value in SECURITY_HEADERS if name not in present]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, with_headers)
