"""Alert delivery: what each receiver is sent, and the dispatcher that sends it.

Notifications are written to ``alert_deliveries`` in the same transaction as the alert change
that caused them (an outbox), so a crash between deciding and sending loses nothing. The
dispatcher leases due notifications, POSTs them, and on failure retries with exponential backoff
(``delivery_backoff_seconds`` doubling up to ``delivery_backoff_max_seconds``); after
``delivery_max_attempts`` a notification is marked failed, kept with its last error, and counted.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from service.background import owner_id, poll, retry_through_outage
from service.schemas import AlertDocument
from service.settings import Settings
from service.storage import queries
from service.storage.tables import Alert, AlertDelivery, as_utc, iso_time, utcnow

log = logging.getLogger("collapse_monitor.alert_delivery")
LEASE_SECONDS = 60.0  # a dispatcher that dies while sending: its deliveries are sent again after this
ICONS = {"firing": ":rotating_light:", "resolved": ":white_check_mark:"}


def alert_document(alert: Alert, run: str) -> AlertDocument:
    """An alert as receivers and the API see it."""
    return AlertDocument(
        rule=alert.rule,
        severity=alert.severity,
        run=run,
        sampler=alert.sampler,
        state=alert.state,
        onset_step=alert.onset_step,
        fired_step=alert.fired_step,
        resolved_step=alert.resolved_step,
        step=alert.last_step,
        value=alert.value,
        baseline=alert.baseline,
        threshold=alert.threshold,
        summary=alert.summary,
        description=alert.description,
    )


def notifications(alert: Alert, run: str, event: str, settings: Settings) -> list[AlertDelivery]:
    """The deliveries one alert event owes every configured receiver."""
    document = alert_document(alert, run).model_dump(mode="json")
    out = [
        AlertDelivery(
            receiver="webhook", url=url, event=event, payload={"version": 1, "event": event, "alert": document}
        )
        for url in settings.alert_webhooks
    ]
    text = f"{ICONS.get(event, '')} *{alert.rule}* ({alert.severity}) {event} on run `{run}`: {alert.summary}"
    out += [
        AlertDelivery(receiver="slack", url=url, event=event, payload={"text": text})
        for url in settings.alert_slack_webhooks
    ]
    if settings.alertmanager_url:
        out.append(
            AlertDelivery(
                receiver="alertmanager",
                url=settings.alertmanager_url.rstrip("/") + "/api/v2/alerts",
                event=event,
                payload={"alerts": [alertmanager_alert(alert, run, event, settings.public_url)]},
            )
        )
    for delivery in out:
        delivery.status, delivery.attempts, delivery.next_attempt_at = "pending", 0, utcnow()
    return out


def alertmanager_alert(alert: Alert, run: str, event: str, public_url: str) -> dict[str, Any]:
    """Alertmanager v2 alert: a firing one is valid for an hour and refreshed at every scored step."""
    now = utcnow()
    starts = as_utc(alert.created_at) or now
    ends = now if event == "resolved" else now + timedelta(hours=1)
    return {
        "labels": {
            "alertname": alert.rule,
            "severity": alert.severity,
            "run": run,
            "sampler": alert.sampler,
            "service": "collapse-monitor",
        },
        "annotations": {"summary": alert.summary, "description": alert.description},
        "startsAt": iso_time(starts),
        "endsAt": iso_time(ends),
        "generatorURL": f"{public_url.rstrip('/')}/v1/runs/{run}/alerts" if public_url else "",
    }


def retry_delay(attempts: int, settings: Settings) -> float:
    """Seconds before the next try after ``attempts`` failed ones: doubling from the first delay, capped."""
    return float(min(settings.delivery_backoff_seconds * 2 ** (attempts - 1), settings.delivery_backoff_max_seconds))


class Dispatcher:
    """Sends due notifications; any number of dispatchers may share the database."""

    def __init__(self, sessions: sessionmaker[Session], settings: Settings, client: httpx.Client) -> None:
        self.sessions = sessions
        self.settings = settings
        self.client = client
        self.owner = owner_id()

    def run(self, stop: threading.Event, poll_seconds: float = 0.5) -> None:
        """Sends due notifications until ``stop`` is set."""
        poll(lambda: self.run_once() > 0, stop, poll_seconds, log, f"alert dispatcher {self.owner}")

    def run_once(self, limit: int = 20) -> int:
        """Tries every due notification once; returns how many it tried."""
        leased_at = time.monotonic()
        with self.sessions.begin() as session:
            claimed = [
                (d.id, d.url, d.payload) for d in queries.claim_deliveries(session, self.owner, LEASE_SECONDS, limit)
            ]
        for delivery_id, url, payload in claimed:
            body = payload["alerts"] if "alerts" in payload and url.endswith("/api/v2/alerts") else payload
            error = self._post(url, body)
            # Through a database outage while the lease holds: giving up would send it again later.
            retry_through_outage(
                functools.partial(self._record_sent, delivery_id, error),
                leased_at + LEASE_SECONDS,
                log,
                f"alert dispatcher {self.owner}: recording delivery {delivery_id}",
            )
        return len(claimed)

    def _record_sent(self, delivery_id: int, error: str | None) -> None:
        with self.sessions.begin() as session:
            delivery = session.get(AlertDelivery, delivery_id)
            if delivery is None or delivery.lease_owner != self.owner:
                return  # another dispatcher took it over after our lease ran out
            self._record(delivery, error)

    def _post(self, url: str, body: Any) -> str | None:
        try:
            response = self.client.post(url, json=body, timeout=10.0)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        if response.is_success:
            return None
        return f"HTTP {response.status_code}: {response.text[:500]}"

    def _record(self, delivery: AlertDelivery, error: str | None) -> None:
        delivery.attempts += 1
        delivery.lease_owner = None
        if error is None:
            delivery.status, delivery.delivered_at, delivery.last_error = "delivered", utcnow(), None
            return
        delivery.last_error = error
        if delivery.attempts >= self.settings.delivery_max_attempts:
            delivery.status = "failed"
            log.error("alert delivery %s to %s failed for good: %s", delivery.id, delivery.url, error)
            return
        delay = retry_delay(delivery.attempts, self.settings)
        delivery.status, delivery.next_attempt_at = "pending", utcnow() + timedelta(seconds=delay)
        log.warning(
            "alert delivery %s to %s failed (try %d), retrying in %.1fs: %s",
            delivery.id,
            delivery.url,
            delivery.attempts,
            delay,
            error,
        )
