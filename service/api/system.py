"""Health, readiness, Prometheus exposition, and the synchronous SNR filter advice."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from scoring.snr_filter import filter_groups
from service.api.deps import AccessFirst, Caller, ReadsNoRunData, State
from service.api.state import AppState
from service.ingest.limits import check_size
from service.metrics import EXPORTED, NAMESPACE
from service.schemas.inputs import FilterRequest, FilterResponse
from service.schemas.reads import CatalogueEntry, CatalogueResponse

router = APIRouter(route_class=AccessFirst)  # POST /v1/filter: access on the headers, then the body


@router.get("/healthz", tags=["system"])
async def healthz() -> dict[str, str]:
    """The process answers (liveness): touches neither the database nor the thread pool."""
    return {"status": "ok"}


@router.get("/readyz", tags=["system"], responses={503: {"description": "Not ready; the body says what is missing"}})
async def readyz(request: Request) -> JSONResponse:
    """Ready when the database answers and is migrated and, with an embedded worker, the default scorer is loaded.

    ``scorers_down`` names the scorers a worker found not answering (since when, the last error) but does
    not make the service unready: it still takes every run's batches, and the other scorers' runs are
    scored; a 503 would take the whole service out of its load balancer for one scorer's server
    (``collapse_monitor_scorer_up`` is the metric to alert on). Answers within a second whatever the
    database does. Async and without the State dependency, whose sync function would wait for the thread
    pool that a hung database may have filled.
    """
    state: AppState = request.app.state.monitor
    checks: dict[str, Any] = {"database": await state.database_probe.check()}
    if not state.settings.embedded_worker or state.settings.scoring_paused:
        checks["scorer"] = "not loaded in this process (no embedded worker)"
        scorer_ok = True
    elif state.scorer_ready.is_set():
        checks["scorer"] = "loaded"
        scorer_ok = True
    else:
        checks["scorer"] = f"failed: {state.scorer_error}" if state.scorer_error else "loading"
        scorer_ok = False
    ready = checks["database"] == "ok" and scorer_ok
    checks["scorers_down"] = state.database_probe.scorers_down
    return JSONResponse({"ready": ready, **checks}, status_code=200 if ready else 503)


@router.get("/metrics", tags=["system"], response_class=Response)
def metrics(state: State, access: Caller) -> Response:
    """Prometheus exposition: per-run diagnostics and service metrics (a read or admin token when
    ``require_token_for_metrics``)."""
    access.metrics()
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/catalogue", tags=["system"], dependencies=[ReadsNoRunData])
def catalogue() -> CatalogueResponse:
    """The diagnostics exported to Prometheus: stored name, gauge name and meaning."""
    return CatalogueResponse(
        metrics=[CatalogueEntry(stored=e.stored, prometheus=f"{NAMESPACE}_{e.name}", help=e.help) for e in EXPORTED]
    )


@router.post(
    "/v1/filter",
    tags=["filter"],
    dependencies=[ReadsNoRunData],
    responses={413: {"description": "Over max_filter_groups or max_filter_rewards"}},
)
def snr_filter(state: State, body: FilterRequest) -> FilterResponse:
    """Which prompt groups RAGEN's SNR-aware filter keeps, and its rollout/... metrics.

    A def handler: the work (linear in the rewards) runs in the thread pool, not on the event loop.
    """
    limit = state.ingest_limits.max_filter_groups
    check_size(
        len(body.rewards),
        limit,
        "a filter request",
        "groups (max_filter_groups)",
        "rewards",
        setting="max_filter_groups",
    )
    # max_filter_rewards: checked on the JSON, before validation (service.api.bodies.check_rewards)
    result = filter_groups(body.rewards, body.filter_config())
    return FilterResponse(**vars(result))
