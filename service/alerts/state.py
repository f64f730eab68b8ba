"""Alert state in storage: re-evaluate a run's rules after a step, reconcile episodes, queue notifications.

The rules themselves are pure (``service.alerts.rules``); this module reads the series they need
(since the (run, sampler)'s checkpoint, or all of it), keeps the checkpoint and writes what
changed, inside the caller's transaction; ``service.alerts.notifications`` sends what it queued. Must
not import fastapi.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from scoring.samplers import is_turn_label
from service.alerts.notifications import notifications
from service.alerts.rules import RULES_VERSION, Episode, Replay, Rewind, Series, needed_series
from service.schemas.alerts import AlertSettings
from service.settings import Settings
from service.snapshot import RunSnapshot
from service.storage import alerts, runs
from service.storage.tables import Alert, utcnow

Event = str  # firing | resolved | refresh (a firing alert re-sent to Alertmanager, which forgets it otherwise)


def update_alerts(
    session: Session,
    run: RunSnapshot,
    step: int,
    samplers: list[str],
    settings: Settings,
    lost: dict[str, list[int]] | None = None,
    segment: int | None = None,
    before: int | None = None,
) -> list[tuple[Alert, str]]:
    """Re-evaluates the run's alert rules after ``step`` and queues the notifications they owe.

    Runs in the transaction that wrote the step's points, so an alert change and its
    notifications are stored together with the figures that caused them. Returns the firing and
    resolved events. ``lost``: per sampler, the group ids of this step's prompts that lost input
    dependence, which a TemplateCollapse alert names. ``segment``: the batch's (None: unknown,
    which replays the whole history). ``before``: the rules read only the steps before it (an
    earlier step of the run still waits to be scored; the points after it wait for its evaluation).

    Each (run, sampler) resumes the rules from its checkpoint and reads only the points written
    since (bounded work per step); it replays the whole history instead, and writes a new
    checkpoint, when there is none yet, when the run resumed from an earlier step since, when this
    step is not after the checkpoint's (a step sent twice), or when the rules say so (``Rewind``).
    Either way the alerts and notifications come out as a whole replay's would.
    """
    events: list[tuple[Alert, Event]] = []
    for sampler in samplers:
        if is_turn_label(sampler):  # the per-turn breakdown is figures to read, not a stream to alert on
            continue
        found = _evaluate(session, run, sampler, step, segment, (lost or {}).get(sampler), before)
        events += _reconcile(session, run.id, sampler, step, found)
    session.flush()  # alert ids for the deliveries
    for alert, event in events:
        _queue_notifications(session, alert, event, run.name, settings)
    return [(a, e) for a, e in events if e != "refresh"]


@dataclass
class _Found:
    """What one evaluation found: the episodes it touched, the pending ones that broke, whether it
    replayed the whole history (then ``episodes`` are all of them)."""

    episodes: list[Episode]
    dropped: list[Episode] = field(default_factory=list)
    is_whole: bool = True


def rules_key(config: AlertSettings) -> str:
    """What a checkpoint's state depends on: the run's alert settings and the rules' version."""
    return hashlib.sha256(f"{RULES_VERSION}:{config.model_dump_json()}".encode()).hexdigest()


def _evaluate(
    session: Session,
    run: RunSnapshot,
    sampler: str,
    step: int,
    segment: int | None,
    lost: list[int] | None,
    before: int | None = None,
) -> _Found:
    config = run.alerts
    if not config.enabled:
        return _Found([])
    checkpoint = alerts.lock_alert_checkpoint(session, run.id, sampler)
    current, key, names = runs.current_segment(session, run.id), rules_key(config), needed_series(config)
    resumable = (
        checkpoint.state is not None
        and checkpoint.rules_key == key
        and checkpoint.segment == current == segment
        and step > checkpoint.step
    )
    found: _Found | None = None
    if resumable:
        new = _until(alerts.alert_series_after(session, run.id, sampler, names, current, checkpoint.step), before)
        replay = Replay(run.name, sampler, config, checkpoint.state)
        try:
            replay.feed(new)
            found = _Found(replay.episodes(lost), replay.dropped, is_whole=False)
        except Rewind:
            pass
    if found is None:
        new = _until(alerts.alert_series(session, run.id, sampler, names), before)
        replay = Replay(run.name, sampler, config)
        replay.feed(new)
        found = _Found(replay.episodes(lost), replay.dropped)
    newest = max((s for points in new.values() for s, _ in points), default=-1)
    checkpoint.state, checkpoint.rules_key, checkpoint.segment = replay.state(), key, current
    checkpoint.step, checkpoint.updated_at = max(newest, checkpoint.step if resumable else -1), utcnow()
    return found


def _until(series: Series, before: int | None) -> Series:
    if before is None:
        return series
    return {name: [(s, v) for s, v in points if s < before] for name, points in series.items()}


def _reconcile(session: Session, run_id: int, sampler: str, step: int, found: _Found) -> list[tuple[Alert, Event]]:
    """Makes the stored alerts of one (run, sampler) match what the evaluation found; returns what changed.

    After a whole replay every stored alert is compared; after a resumed one only those it touched
    (the rest cannot have changed: their episodes ended before the checkpoint). A pending episode
    whose condition broke is kept as a record in state ``dropped``, with its figures: nothing is notified.
    """
    touched = [*found.episodes, *found.dropped]
    if found.is_whole:
        stored = {(a.rule, a.onset_step): a for a in alerts.alerts_of(session, run_id, sampler)}
    else:
        stored = {
            (a.rule, a.onset_step): a
            for a in alerts.alerts_at(session, run_id, sampler, [e.onset_step for e in touched])
        }
    events: list[tuple[Alert, Event]] = []
    for episode in touched:
        alert = stored.pop((episode.rule, episode.onset_step), None)
        before = alert.state if alert is not None else None
        if alert is None:
            alert = Alert(run_id=run_id, sampler=sampler, rule=episode.rule, onset_step=episode.onset_step)
            session.add(alert)
        _store(alert, episode)
        if episode.state == "firing" and before != "firing":
            events.append((alert, "firing"))
        elif episode.state == "resolved" and before == "firing":
            events.append((alert, "resolved"))
        elif episode.state == "firing" and episode.last_step == step:
            events.append((alert, "refresh"))
    # After a whole replay, what is left is history it no longer has (after a resumed one: other rules'
    # alerts that began at a step the replay touched, unchanged).
    for alert in stored.values() if found.is_whole else ():
        if alert.state in ("pending", "dropped"):
            session.delete(alert)
        elif alert.state == "firing":
            # The history it fired on was superseded (the run resumed from an earlier step).
            alert.state, alert.resolved_step, alert.updated_at = "resolved", alert.last_step, utcnow()
            alert.summary += f" (superseded: the run resumed before step {alert.onset_step})"
            events.append((alert, "resolved"))
    return events


def _store(alert: Alert, episode: Episode) -> None:
    """Writes an episode's figures into its alert; ``updated_at`` moves only when one of them changed."""
    values = {
        "severity": episode.severity,
        "state": episode.state,
        "fired_step": episode.fired_step,
        "resolved_step": episode.resolved_step,
        "last_step": episode.last_step,
        "value": episode.value,
        "baseline": episode.baseline,
        "threshold": episode.threshold,
        "summary": episode.summary,
        "description": episode.description,
    }
    if any(getattr(alert, name) != value for name, value in values.items()):
        for name, value in values.items():
            setattr(alert, name, value)
        alert.updated_at = utcnow()


def _queue_notifications(session: Session, alert: Alert, event: Event, run_name: str, settings: Settings) -> None:
    if event == "refresh":  # only Alertmanager needs a firing alert re-sent
        owed = [d for d in notifications(alert, run_name, "firing", settings) if d.receiver == "alertmanager"]
    else:
        owed = notifications(alert, run_name, event, settings)
    for delivery in owed:
        delivery.alert_id = alert.id
    session.add_all(owed)
