"""create_app(settings): the composition root. Everything is built in the lifespan, nothing at import.

The scorer pool and the embedded worker (and with them torch) are imported only when this process
scores; an API-only process (``serve --no-worker``) never loads a model library.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from sqlalchemy import exc
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException

from service.access import TokenCache
from service.api import alerts, batches, matrices, overview, pages, runs, system
from service.api.bodies import MAX_LISTED_ERRORS, BodyValidationError
from service.api.middleware import (
    AnswerErrors,
    BodyLimit,
    BodyTooLarge,
    CountRequests,
    NoNulInUrl,
    OneOfEachHeader,
    RateLimit,
    SameOrigin,
    SecurityHeaders,
    TrustedHosts,
)
from service.api.rate_limit import BodyBudget
from service.api.state import AppState
from service.errors import DatabaseUnavailable, MonitorError, StorageFull, field_path, rejection_reasons
from service.ingest.limits import IngestLimits
from service.metrics import (
    SCORING_SECONDS_BUCKETS,
    DiagnosticsCollector,
    MetricsSnapshot,
    ServiceMetrics,
    SnapshotCache,
)
from service.runtime import Background, Loop
from service.settings import Settings
from service.storage.alerts import active_alerts, delivery_counts
from service.storage.database import STORAGE_FULL, first_line, make_engine, make_sessions, migrate, outage
from service.storage.points import latest_values
from service.storage.queue import batch_counts, scoring_stats
from service.storage.readiness import DatabaseProbe
from service.storage.scorer_outages import scorers_down

log = logging.getLogger("collapse_monitor")


def read_snapshot(sessions: sessionmaker[Session], scorers: Iterable[str] = ()) -> MetricsSnapshot:
    """What /metrics exports, read in one session (``SnapshotCache`` keeps it for metrics_cache_seconds);
    ``scorers``: the named scorers, each exported up unless a worker found it down."""
    with sessions() as session:
        return MetricsSnapshot(
            latest=list(latest_values(session)),
            batches=batch_counts(session),
            scoring=scoring_stats(session, SCORING_SECONDS_BUCKETS),
            buckets=SCORING_SECONDS_BUCKETS,
            alerts=active_alerts(session),
            deliveries=delivery_counts(session),
            scorers=tuple(scorers),
            scorers_down=tuple(scorers_down(session)),
        )


def snapshot_outage(error: BaseException) -> str | None:
    """One log line for a snapshot read that failed because the database is away; None for anything else."""
    reason = outage(error)
    return f"database {reason}: {first_line(getattr(error, 'orig', None) or error)}" if reason else None


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.resolved_database_url
        if settings.auto_migrate:
            migrate(url)
        engine = make_engine(url, **settings.database_timeouts)
        sessions = make_sessions(engine)
        registry = CollectorRegistry()
        state = AppState(
            settings=settings,
            engine=engine,
            sessions=sessions,
            registry=registry,
            metrics=ServiceMetrics(registry, rejection_reasons()),
            tokens=TokenCache(sessions, settings.token_cache_seconds),
            database_probe=DatabaseProbe(engine, url),
            bodies=BodyBudget(settings.max_parsing_bytes),
            ingest_limits=IngestLimits.of(settings),
        )
        snapshot = SnapshotCache(lambda: read_snapshot(sessions, settings.scorers), settings.metrics_cache_seconds)
        registry.register(DiagnosticsCollector(snapshot, settings.max_exported_series, snapshot_outage))
        app.state.monitor = state
        worker = _embedded_worker(state) if settings.embedded_worker and not settings.scoring_paused else None
        try:
            with Background(sessions, settings, worker=worker, purge=True):
                yield
        finally:
            engine.dispose()

    app = FastAPI(
        title="collapse-monitor",
        version="0.1.0",
        description="Template-collapse diagnostics (RAGEN-2) for agentic RL training runs.\n\n"
        "Once the server has API tokens, writes need `Authorization: Bearer <token>` (an ingest token for the "
        "run's name prefix, or an admin token); reads and /metrics need one when the server is configured so. "
        "Refusals answer 401 or 403 in the usual error shape (docs/api.md, API tokens).",
        lifespan=lifespan,
        # /docs is service.api.pages' (vendored Swagger UI, no CDN); FastAPI's ReDoc would load from one.
        docs_url=None,
        redoc_url=None,
    )
    app.include_router(runs.router)
    app.include_router(batches.router)
    app.include_router(alerts.router)
    app.include_router(system.router)
    app.include_router(overview.router)
    app.include_router(matrices.router)
    app.include_router(pages.router)
    app.mount("/static", pages.static_files(), name="static")
    app.add_exception_handler(MonitorError, _monitor_error)  # type: ignore[arg-type]  # Starlette's handler type is loose
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]  # as above
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]  # as above
    app.add_exception_handler(exc.DBAPIError, _database_error)  # type: ignore[arg-type]  # as above
    app.add_exception_handler(exc.TimeoutError, _database_error)  # type: ignore[arg-type]  # as above
    # Added innermost first: a request meets SecurityHeaders, AnswerErrors, CountRequests, TrustedHosts,
    # RateLimit, SameOrigin, NoNulInUrl, BodyLimit, then the routes.
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(NoNulInUrl)
    app.add_middleware(SameOrigin, allowed_origins=settings.allowed_origins)
    if settings.rate_limit_per_second > 0:
        app.add_middleware(RateLimit, rate=settings.rate_limit_per_second, burst=settings.rate_limit_burst)
    app.add_middleware(TrustedHosts, allowed=settings.trusted_hosts)
    app.add_middleware(OneOfEachHeader)  # before the host check and the rate limiter read either header
    app.add_middleware(CountRequests)
    app.add_middleware(AnswerErrors)
    app.add_middleware(SecurityHeaders)
    return app


def _embedded_worker(state: AppState) -> Loop:
    """Scores in this process; the default scorer starts loading at once (/readyz reports it)."""
    from service.jobs.scorers import ScorerPool
    from service.jobs.worker import Worker

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
    return Worker(state.sessions, state.settings, pool).run


async def _monitor_error(request: Request, error: MonitorError) -> JSONResponse:
    request.app.state.monitor.metrics.rejections.labels(error.code).inc()
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    request.app.state.monitor.metrics.rejections.labels("validation").inc()
    errors = error.errors()
    n_errors = error.n_errors if isinstance(error, BodyValidationError) else len(errors)
    detail = []
    for e in errors[:MAX_LISTED_ERRORS]:
        message, field = e["msg"], field_path(e["loc"]) or "body"
        if e["type"] == "json_invalid":  # its location is a character offset, not a field
            field = "body"
            message = f"{message}: {e.get('ctx', {}).get('error', 'not valid JSON')} (at character {e['loc'][-1]})"
        detail.append({"loc": list(e["loc"]), "field": field, "msg": message, "type": e["type"]})
    return JSONResponse({"error": "validation", "detail": detail, "n_errors": n_errors}, status_code=422)


async def _database_error(request: Request, error: exc.SQLAlchemyError) -> JSONResponse:
    """503 + Retry-After while the database is unreachable or times out; any other database error is a bug."""
    reason = outage(error)
    if reason is None:
        raise error  # AnswerErrors logs it and answers 500
    cause = getattr(error, "orig", None) or error
    log.warning("%s %s: database %s: %s", request.method, request.url.path, reason, first_line(cause))
    if reason == STORAGE_FULL:
        request.app.state.monitor.database_probe.note_storage_full()
        detail = f"{reason}; nothing of this request was kept. An operator frees space (payload_retention_days)"
        return await _monitor_error(request, StorageFull(detail))
    detail = f"the database is unavailable ({reason}); retry after the Retry-After header"
    return await _monitor_error(request, DatabaseUnavailable(detail))


HTTP_ERROR_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown route, wrong method, unreadable body) in the documented shape."""
    code = HTTP_ERROR_CODES.get(error.status_code, "invalid_request" if error.status_code < 500 else "internal_error")
    detail = str(error.detail)
    if detail == "There was an error parsing the body":  # FastAPI's words for a body json cannot read
        detail = "the body must be a JSON object in UTF-8, nested at most a few hundred levels; it could not be read"
    reason = "body_too_large" if isinstance(error, BodyTooLarge) else code
    request.app.state.monitor.metrics.rejections.labels(reason).inc()
    field = "body" if error.status_code == 400 else None
    body: dict[str, object] = {"error": code, "detail": detail, "field": field, "index": None}
    if isinstance(error, BodyTooLarge):
        body |= error.limits
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)
