"""create_app(settings): the composition root. Everything is built in the lifespan, nothing at import.

The scorer pool and the embedded worker (and with them torch) are imported only when this process
scores; an API-only process (``serve --no-worker``) never loads a model library.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from service.alert_delivery import Dispatcher
from service.api import alerts, batches, runs, system
from service.background import start_in_thread
from service.errors import MonitorError, TooLarge, Unavailable, field_path
from service.metrics import DiagnosticsCollector, MetricsSnapshot, ServiceMetrics
from service.settings import Settings
from service.state import AppState
from service.storage import queries
from service.storage.database import make_engine, make_sessions, migrate

log = logging.getLogger("collapse_monitor")


def read_snapshot(sessions: sessionmaker[Session]) -> MetricsSnapshot:
    with sessions() as session:
        return MetricsSnapshot(
            latest=list(queries.latest_values(session)),
            batches=queries.batch_counts(session),
            scoring=queries.scoring_stats(session),
            buckets=queries.SCORING_SECONDS_BUCKETS,
            alerts=queries.active_alerts(session),
            deliveries=queries.delivery_counts(session),
        )


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.resolved_database_url
        if settings.auto_migrate:
            migrate(url)
        engine = make_engine(url)
        sessions = make_sessions(engine)
        registry = CollectorRegistry()
        state = AppState(
            settings=settings, engine=engine, sessions=sessions, registry=registry, metrics=ServiceMetrics(registry)
        )
        registry.register(DiagnosticsCollector(lambda: read_snapshot(sessions)))
        app.state.monitor = state
        threads = []
        if settings.embedded_worker and not settings.scoring_paused:
            threads.append(_start_embedded_worker(state))
        http = httpx.Client()
        threads.append(start_in_thread(Dispatcher(sessions, settings, http).run, "collapse-monitor-alerts"))
        try:
            yield
        finally:
            for _, stop in threads:
                stop.set()
            for thread, _ in threads:
                thread.join(timeout=60)
            http.close()
            engine.dispose()

    app = FastAPI(
        title="collapse-monitor",
        version="0.1.0",
        description="Template-collapse diagnostics (RAGEN-2) for agentic RL training runs.",
        lifespan=lifespan,
    )
    app.include_router(runs.router)
    app.include_router(batches.router)
    app.include_router(alerts.router)
    app.include_router(system.router)
    app.add_exception_handler(MonitorError, _monitor_error)  # type: ignore[arg-type]  # Starlette's handler type is loose
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]  # as above
    app.add_exception_handler(BodyTooLarge, _body_too_large)  # type: ignore[arg-type]  # as above
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)

    app.add_middleware(_CountRequests)
    return app


def _start_embedded_worker(state: AppState) -> tuple[threading.Thread, threading.Event]:
    """Scores in this process; the default scorer starts loading at once (/readyz reports it)."""
    from service.scorers import ScorerPool
    from service.worker import Worker

    pool = state.pool = ScorerPool(state.settings)

    def preload() -> None:
        try:
            pool.get(state.settings.default_scorer)
        except Exception as e:  # reported by /readyz rather than crashing the server
            log.exception("loading the default scorer failed")
            state.scorer_error = f"{type(e).__name__}: {e}"
        else:
            state.scorer_ready.set()

    threading.Thread(target=preload, name="scorer-preload", daemon=True).start()
    return start_in_thread(Worker(state.sessions, state.settings, pool).run, "collapse-monitor-worker")


async def _monitor_error(request: Request, error: MonitorError) -> JSONResponse:
    request.app.state.monitor.metrics.rejections.labels(error.code).inc()
    headers = {"Retry-After": str(error.retry_after)} if isinstance(error, Unavailable) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    request.app.state.monitor.metrics.rejections.labels("validation").inc()
    detail = [
        {"loc": list(e["loc"]), "field": field_path(e["loc"]), "msg": e["msg"], "type": e["type"]}
        for e in error.errors()
    ]
    return JSONResponse({"error": "validation", "detail": detail}, status_code=422)


class _CountRequests:
    """Counts answered requests by method, route template and status (plain ASGI: no body copies)."""

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
                state.metrics.requests.labels(scope["method"], template, status).inc()


class _BodyLimit:
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
        app = scope.get("app")
        state = getattr(getattr(app, "state", None), "monitor", None)
        if state is not None:
            state.metrics.rejections.labels("body_too_large").inc()
        error = TooLarge(f"request bodies may hold at most {self.limit} bytes, got {size}")
        await JSONResponse(error.body(), status_code=error.status)(scope, _drain, send)


class BodyTooLarge(HTTPException):
    """Raised while a body without a declared length is read, once it passes the limit."""

    def __init__(self, limit: int, size: int) -> None:
        super().__init__(
            status_code=413, detail=f"request bodies may hold at most {limit} bytes, got more than {size - 1}"
        )


async def _body_too_large(request: Request, error: BodyTooLarge) -> JSONResponse:
    request.app.state.monitor.metrics.rejections.labels("body_too_large").inc()
    refusal = TooLarge(str(error.detail))
    return JSONResponse(refusal.body(), status_code=refusal.status)


async def _drain() -> MutableMapping[str, Any]:
    return {"type": "http.disconnect"}
