"""Alert delivery: what each receiver is sent, and the dispatcher that sends it.

Notifications are written to ``alert_deliveries`` in the same transaction as the alert change
that caused them (an outbox), so a crash between deciding and sending loses nothing. The
dispatcher leases due notifications, POSTs them, and on failure retries with exponential backoff
(``delivery_backoff_seconds`` doubling up to ``delivery_backoff_max_seconds``); after
``delivery_max_attempts`` a notification is marked failed, kept with its last error, and counted.

A receiver's URL is a credential (a Slack or generic webhook's path is its secret; an
Alertmanager URL may carry a password): it is used to send and nowhere else. Reads and logs show
a receiver as its kind and ``redacted_url`` (scheme and host), and its error as
``redacted_error`` (status and a short reason, without URLs or token-like strings).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import httpx
from sqlalchemy.orm import Session, sessionmaker

from service.background import owner_id, poll, retry_through_outage
from service.schemas import AlertDocument, DeliveryStatus
from service.settings import Settings
from service.storage import queries
from service.storage.tables import Alert, AlertDelivery, as_utc, iso_time, utcnow

log = logging.getLogger("collapse_monitor.alert_delivery")
# httpx's timeout of each phase of a POST (connect, write, read, a free connection); a response's
# body is read only as far as ERROR_BYTES, so one send takes at most about 3 x this.
SEND_TIMEOUT_SECONDS = 10.0
ERROR_BYTES = 1024
# The lease of one notification, taken just before it is sent: it must outlast one send (about
# 30 s, above) and the recording of its outcome, or another dispatcher would send it too. A
# dispatcher that dies mid-send: its notification is sent again after this (at least once).
LEASE_SECONDS = 2 * 3 * SEND_TIMEOUT_SECONDS
ERROR_CHARS = 200  # of a receiver's error, kept and shown: the status and a short reason
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
        delivery.status, delivery.attempts = "pending", 0
        # Due at once by the database's clock, which claims compare it with (not this host's).
        delivery.next_attempt_at = queries.db_time()
    return out


def delivery_status(delivery: AlertDelivery) -> DeliveryStatus:
    """A notification as reads show it: the receiver by kind and host, its error redacted."""
    return DeliveryStatus(
        receiver=delivery.receiver,
        url=redacted_url(delivery.url),
        event=delivery.event,
        status=delivery.status,
        attempts=delivery.attempts,
        last_error=redacted_error(delivery.last_error, delivery.url) if delivery.last_error else None,
        delivered_at=iso_time(delivery.delivered_at),
    )


def redacted_url(url: str) -> str:
    """``https://hooks.slack.com/…``: a receiver's scheme and host (and port); credentials, path and query left out."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:  # not a URL httpx could send to either
        return "…"
    if not host:
        return "…"
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}/…"


# A secret-looking run of characters: 16 or more of a token's alphabet holding a digit, or 32 or more of any.
_TOKEN_LIKE = re.compile(r"[A-Za-z0-9_\-.~+/=%]{16,}")
_URL_LIKE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s;,)\"'<>]*")


def _is_token_like(text: str) -> bool:
    return len(text) >= 32 or (any(c.isdigit() for c in text) and any(c.isalpha() for c in text))


def _secret_parts(url: str) -> set[str]:
    """The parts of a receiver's URL that may be its secret: credentials, and path or query parts that look random."""
    try:
        parts = urlsplit(url)
        credentials = {parts.username or "", parts.password or ""}
    except ValueError:
        return set()
    pieces = parts.path.split("/") + [v for pair in parse_qsl(parts.query, keep_blank_values=True) for v in pair]
    pieces += [unquote(p) for p in pieces]
    # "services", "hooks", "api" stay readable; "T0ABC123", a 24-character token, a long word do not.
    return {url, *credentials} | {p for p in pieces if len(p) >= 12 or (len(p) >= 4 and _is_token_like(p))}


def redacted_error(error: str, url: str) -> str:
    """A receiver's error as kept and shown: the status and a short reason, no secret.

    Receivers echo what they were sent (a 404 page naming the path; httpx names the URL), so the
    URL, its credentials and the random-looking parts of its path and query, any other URL and
    anything that looks like a token are cut out; then whitespace is folded and the text cut to
    ``ERROR_CHARS``.
    """
    text = error
    for secret in sorted(_secret_parts(url), key=len, reverse=True):
        if len(secret) >= 4:
            text = text.replace(secret, "…")
    text = _URL_LIKE.sub("<url>", text)
    text = _TOKEN_LIKE.sub(lambda m: "…" if _is_token_like(m.group()) else m.group(), text)
    text = " ".join(text.split())
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 1] + "…"


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


class RedactedRequestLog(logging.Filter):
    """httpx logs every request's whole URL at INFO: shown as ``redacted_url`` (a receiver's URL is a credential)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if str(record.msg).startswith("HTTP Request:") and isinstance(args, tuple) and len(args) >= 2:
            record.args = (args[0], redacted_url(str(args[1])), *args[2:])
        return True


class Dispatcher:
    """Sends due notifications; any number of dispatchers may share the database."""

    def __init__(self, sessions: sessionmaker[Session], settings: Settings, client: httpx.Client) -> None:
        self.sessions = sessions
        self.settings = settings
        self.client = client
        self.owner = owner_id()
        requests = logging.getLogger("httpx")  # the logger httpx writes its request lines to
        if not any(isinstance(f, RedactedRequestLog) for f in requests.filters):
            requests.addFilter(RedactedRequestLog())

    def run(self, stop: threading.Event, poll_seconds: float = 0.5) -> None:
        """Sends due notifications until ``stop`` is set."""
        poll(lambda: self.run_once() > 0, stop, poll_seconds, log, f"alert dispatcher {self.owner}")

    def run_once(self, limit: int = 20) -> int:
        """Tries up to ``limit`` due notifications once each; returns how many it tried.

        Each is leased just before it is sent (one transaction each), so a lease covers one send,
        however slow the receivers before it were.
        """
        tried = 0
        while tried < limit:
            leased_at = time.monotonic()
            with self.sessions.begin() as session:
                claimed = [
                    (d.id, d.receiver, d.url, d.payload, d.attempts)
                    for d in queries.claim_deliveries(session, self.owner, LEASE_SECONDS, 1)
                ]
            if not claimed:
                break
            ((delivery_id, receiver, url, payload, attempts),) = claimed
            body = payload["alerts"] if "alerts" in payload and url.endswith("/api/v2/alerts") else payload
            error = self._post(url, body)
            # Through a database outage while the lease holds: giving up would send it again later.
            retry_through_outage(
                functools.partial(self._record_sent, delivery_id, receiver, url, attempts + 1, error),
                leased_at + LEASE_SECONDS,
                log,
                f"alert dispatcher {self.owner}: recording delivery {delivery_id}",
            )
            tried += 1
        return tried

    def _post(self, url: str, body: Any) -> str | None:
        """None when the receiver took it; else why not, redacted (the URL is the receiver's secret)."""
        try:
            with self.client.stream("POST", url, json=body, timeout=SEND_TIMEOUT_SECONDS) as response:
                if response.is_success:
                    return None
                head = b""
                for chunk in response.iter_bytes():
                    head += chunk
                    if len(head) >= ERROR_BYTES:
                        break
        except httpx.HTTPError as e:
            return redacted_error(f"{type(e).__name__}: {e}", url)
        return redacted_error(f"HTTP {response.status_code}: {head[:ERROR_BYTES].decode(errors='replace')}", url)

    def _record_sent(self, delivery_id: int, receiver: str, url: str, attempts: int, error: str | None) -> None:
        where = f"{receiver} {redacted_url(url)}"
        if error is None:
            status, retry = "delivered", None
        elif attempts >= self.settings.delivery_max_attempts:
            status, retry = "failed", None
        else:
            status, retry = "pending", retry_delay(attempts, self.settings)
        with self.sessions.begin() as session:
            if not queries.record_delivery(
                session, delivery_id, self.owner, status=status, error=error, retry_seconds=retry
            ):
                log.warning(
                    "alert delivery %s to %s: another dispatcher took it over; not recorded", delivery_id, where
                )
                return
        if status == "failed":
            log.error("alert delivery %s to %s failed for good: %s", delivery_id, where, error)
        elif status == "pending":
            log.warning(
                "alert delivery %s to %s failed (try %d), retrying in %.1fs: %s",
                delivery_id,
                where,
                attempts,
                retry,
                error,
            )
