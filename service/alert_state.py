"""Alert state in storage: re-evaluate a run's rules after a step, reconcile episodes, queue notifications.

The rules themselves are pure (``service.alert_rules``); this module reads the series they need
and writes what changed, inside the caller's transaction; ``service.alert_delivery`` sends what it
queued. Must not import fastapi.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.alert_delivery import notifications
from service.alert_rules import Episode, evaluate, needed_series
from service.runs import RunSnapshot
from service.settings import Settings
from service.storage import queries
from service.storage.tables import Alert, utcnow

Event = str  # firing | resolved | refresh (a firing alert re-sent to Alertmanager, which forgets it otherwise)


def update_alerts(
    session: Session,
    run: RunSnapshot,
    step: int,
    samplers: list[str],
    settings: Settings,
    lost: dict[str, list[int]] | None = None,
) -> list[tuple[Alert, str]]:
    """Re-evaluates the run's alert rules after ``step`` and queues the notifications they owe.

    Runs in the transaction that wrote the step's points, so an alert change and its
    notifications are stored together with the figures that caused them. Returns the firing and
    resolved events. ``lost``: per sampler, the group ids of this step's prompts that lost input
    dependence, which a TemplateCollapse alert names.
    """
    events: list[tuple[Alert, Event]] = []
    for sampler in samplers:
        series = queries.alert_series(session, run.id, sampler, needed_series(run.alerts))
        episodes = evaluate(run.name, sampler, series, run.alerts, (lost or {}).get(sampler))
        events += _reconcile(session, run.id, sampler, step, episodes)
    session.flush()  # alert ids for the deliveries
    for alert, event in events:
        _queue_notifications(session, alert, event, run.name, settings)
    return [(a, e) for a, e in events if e != "refresh"]


def _reconcile(
    session: Session, run_id: int, sampler: str, step: int, episodes: list[Episode]
) -> list[tuple[Alert, Event]]:
    """Makes the stored alerts of one (run, sampler) match ``episodes``; returns what changed."""
    stored: dict[tuple[str, int], Alert] = {
        (a.rule, a.onset_step): a for a in queries.alerts_of(session, run_id, sampler)
    }
    events: list[tuple[Alert, Event]] = []
    for episode in episodes:
        alert = stored.pop((episode.rule, episode.onset_step), None)
        before = alert.state if alert is not None else None
        if alert is None:
            alert = Alert(run_id=run_id, sampler=sampler, rule=episode.rule, onset_step=episode.onset_step)
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
    for alert in stored.values():
        if alert.state == "pending":
            session.delete(alert)  # its condition broke before it fired: nothing to tell
        elif alert.state == "firing":
            # The history it fired on was superseded (the run resumed from an earlier step).
            alert.state, alert.resolved_step, alert.updated_at = "resolved", alert.last_step, utcnow()
            alert.summary += f" (superseded: the run resumed before step {alert.onset_step})"
            events.append((alert, "resolved"))
    return events


def _queue_notifications(session: Session, alert: Alert, event: Event, run_name: str, settings: Settings) -> None:
    if event == "refresh":  # only Alertmanager needs a firing alert re-sent
        owed = [d for d in notifications(alert, run_name, "firing", settings) if d.receiver == "alertmanager"]
    else:
        owed = notifications(alert, run_name, event, settings)
    for delivery in owed:
        delivery.alert_id = alert.id
    session.add_all(owed)
