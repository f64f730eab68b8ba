"""Alert state in storage: re-evaluate a run's rules after a step, reconcile episodes, queue notifications.

The rules themselves are pure (``service.alerts``); this module reads the series they need and
writes what changed, inside the caller's transaction. Must not import fastapi.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from service.alerts import evaluate, needed_series
from service.delivery import notifications
from service.settings import Settings
from service.storage import queries
from service.storage.tables import Alert, utcnow

if TYPE_CHECKING:
    from service.pipeline import RunSnapshot


def update_alerts(
    session: Session, run: RunSnapshot, step: int, samplers: list[str], settings: Settings
) -> list[tuple[Alert, str]]:
    """Re-evaluates the run's alert rules after ``step`` and queues the notifications they owe.

    Runs in the transaction that wrote the step's points, so an alert change and its
    notifications are stored together with the figures that caused them.
    """
    events: list[tuple[Alert, str]] = []
    for sampler in samplers:
        series = queries.alert_series(session, run.id, sampler, needed_series(run.alerts))
        stored = {(a.rule, a.onset_step): a for a in queries.alerts_of(session, run.id, sampler)}
        current = set()
        for episode in evaluate(run.name, sampler, series, run.alerts):
            key = (episode.rule, episode.onset_step)
            current.add(key)
            alert = stored.get(key)
            before = alert.state if alert is not None else None
            if alert is None:
                alert = Alert(run_id=run.id, sampler=sampler, rule=episode.rule, onset_step=episode.onset_step)
                session.add(alert)
            alert.severity, alert.state, alert.fired_step = episode.severity, episode.state, episode.fired_step
            alert.resolved_step, alert.last_step, alert.value = episode.resolved_step, episode.last_step, episode.value
            alert.baseline, alert.threshold = episode.baseline, episode.threshold
            alert.summary, alert.description, alert.updated_at = episode.summary, episode.description, utcnow()
            if episode.state == "firing" and before != "firing":
                events.append((alert, "firing"))
            elif episode.state == "resolved" and before == "firing":
                events.append((alert, "resolved"))
            elif episode.state == "firing" and episode.last_step == step:
                events.append((alert, "refresh"))
        for key, alert in stored.items():
            if key not in current and alert.state == "pending":
                session.delete(alert)  # its condition broke before it fired: nothing to tell
    session.flush()
    for alert, event in events:
        if event == "refresh":  # Alertmanager forgets firing alerts that are not re-sent
            owed = [d for d in notifications(alert, run.name, "firing", settings) if d.receiver == "alertmanager"]
        else:
            owed = notifications(alert, run.name, event, settings)
        for delivery in owed:
            delivery.alert_id = alert.id
        session.add_all(owed)
    return [(a, e) for a, e in events if e != "refresh"]
