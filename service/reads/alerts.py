"""Alerts as the API answers them: each episode with its run, state, figures and its notifications' delivery.

Must not import fastapi.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.alerts.notifications import delivery_status
from service.reads.runs import require_run
from service.schemas.alerts import AlertResponse, AlertState, DeliveryStatus, RuleName
from service.schemas.rows import from_row
from service.storage import alerts


def alert_responses(
    session: Session, run: str | None, state: AlertState | None, rule: RuleName | None
) -> list[AlertResponse]:
    """Alerts, oldest first: of the run called ``run`` (404 if none) or of every run; only ``state`` and
    ``rule`` when given (dropped records only when ``state`` asks for them). Two queries."""
    run_id = require_run(session, run).id if run is not None else None
    rows = alerts.list_alerts(session, run_id, state, rule)
    deliveries: dict[int, list[DeliveryStatus]] = {}
    for d in alerts.deliveries_of(session, [a.id for a, _ in rows]):
        deliveries.setdefault(d.alert_id, []).append(delivery_status(d))
    return [
        from_row(AlertResponse, alert, run=run_name, step=alert.last_step, deliveries=deliveries.get(alert.id, []))
        for alert, run_name in rows
    ]
