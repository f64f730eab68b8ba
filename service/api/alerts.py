"""Alerts: every episode with its state, figures and the delivery of its notifications."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.alerts.notifications import delivery_status
from service.api.deps import Caller, ReadsRun, State
from service.ingest.runs import require_run
from service.schemas.alerts import AlertResponse, AlertState, DeliveryStatus, RuleName
from service.schemas.rows import from_row
from service.storage import alerts

router = APIRouter(tags=["alerts"])
StateFilter = Annotated[
    AlertState | None,
    Query(
        alias="state",
        description="Only this state. Without it: pending, firing and resolved alerts; dropped ones (pending "
        "episodes whose condition broke before they fired, kept as records) only with state=dropped.",
    ),
]
RuleFilter = Annotated[RuleName | None, Query(description="Only this rule.")]


@router.get("/v1/alerts")
def list_alerts(
    state: State,
    access: Caller,
    alert_state: StateFilter = None,
    rule: RuleFilter = None,
    run: Annotated[str | None, Query(description="Only this run.")] = None,
) -> list[AlertResponse]:
    """Alerts of every run, oldest first."""
    access.read([run] if run is not None else None)
    with state.sessions() as session:
        run_id = require_run(session, run).id if run is not None else None
        rows = alerts.list_alerts(session, run_id, alert_state, rule)
        deliveries: dict[int, list[DeliveryStatus]] = {}
        for d in alerts.deliveries_of(session, [a.id for a, _ in rows]):
            deliveries.setdefault(d.alert_id, []).append(delivery_status(d))
        return [
            from_row(AlertResponse, alert, run=run_name, step=alert.last_step, deliveries=deliveries.get(alert.id, []))
            for alert, run_name in rows
        ]


@router.get("/v1/runs/{run}/alerts", dependencies=[ReadsRun])
def run_alerts(
    state: State, access: Caller, run: str, alert_state: StateFilter = None, rule: RuleFilter = None
) -> list[AlertResponse]:
    """Alerts of one run, oldest first."""
    return list_alerts(state, access, alert_state, rule, run)
