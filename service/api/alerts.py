"""Alerts: every episode with its state, figures and the delivery of its notifications."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.api.deps import Caller, ReadsRun, State
from service.reads.alerts import alert_responses
from service.schemas.alerts import AlertResponse, AlertState, RuleName

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
        return alert_responses(session, run, alert_state, rule)


@router.get("/v1/runs/{run}/alerts", dependencies=[ReadsRun])
def run_alerts(state: State, run: str, alert_state: StateFilter = None, rule: RuleFilter = None) -> list[AlertResponse]:
    """Alerts of one run, oldest first."""
    with state.sessions() as session:
        return alert_responses(session, run, alert_state, rule)
