"""Alerts: every episode with its state, figures and the delivery of its notifications."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from service.api.deps import State
from service.delivery import alert_document
from service.errors import NotFound
from service.storage import queries

router = APIRouter(tags=["alerts"])
StateFilter = Annotated[Literal["pending", "firing", "resolved"] | None, Query(description="Only this state.")]
RuleFilter = Annotated[
    Literal["TemplateCollapse", "EntropyCollapse", "LowRewardSignal"] | None, Query(description="Only this rule.")
]


def _listing(state: State, run_id: int | None, alert_state: str | None, rule: str | None) -> list[dict[str, Any]]:
    with state.sessions() as session:
        rows = queries.list_alerts(session, run_id, alert_state, rule)
        deliveries: dict[int, list[dict[str, Any]]] = {}
        for d in queries.deliveries_of(session, [a.id for a, _ in rows]):
            deliveries.setdefault(d.alert_id, []).append(
                {
                    "receiver": d.receiver,
                    "url": d.url,
                    "event": d.event,
                    "status": d.status,
                    "attempts": d.attempts,
                    "last_error": d.last_error,
                    "delivered_at": _iso(d.delivered_at),
                }
            )
        return [
            {
                "id": alert.id,
                **alert_document(alert, run),
                "created_at": _iso(alert.created_at),
                "updated_at": _iso(alert.updated_at),
                "deliveries": deliveries.get(alert.id, []),
            }
            for alert, run in rows
        ]


def _iso(moment: Any) -> str | None:
    value = queries.as_utc(moment)
    return value.isoformat() if value else None


@router.get("/v1/alerts")
def list_alerts(
    state: State,
    alert_state: Annotated[StateFilter, Query(alias="state")] = None,
    rule: RuleFilter = None,
    run: Annotated[str | None, Query(description="Only this run.")] = None,
) -> list[dict[str, Any]]:
    """Alerts of every run, oldest first."""
    run_id = None
    if run is not None:
        with state.sessions() as session:
            found = queries.run_by_name(session, run)
            if found is None:
                raise NotFound(f"run {run!r} does not exist", field="run")
            run_id = found.id
    return _listing(state, run_id, alert_state, rule)


@router.get("/v1/runs/{run}/alerts")
def run_alerts(
    state: State, run: str, alert_state: Annotated[StateFilter, Query(alias="state")] = None, rule: RuleFilter = None
) -> list[dict[str, Any]]:
    """Alerts of one run, oldest first."""
    return list_alerts(state, alert_state, rule, run)
