"""What each receiver is sent: the alert document, the outbox rows queued with an alert change, redaction.

Notifications are written to ``alert_deliveries`` in the same transaction as the alert change
that caused them (an outbox), so a crash between deciding and sending loses nothing;
``service.alerts.dispatcher`` sends them.

A receiver's URL is a credential (a Slack or generic webhook's path is its secret; an
Alertmanager URL may carry a password): it is used to send and nowhere else. Reads and logs show
a receiver as its kind and ``redacted_url`` (scheme and host), and its error as
``redacted_error`` (status and a short reason, without URLs or token-like strings).
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from service.schemas.alerts import AlertDocument, DeliveryStatus
from service.schemas.rows import from_row
from service.settings import Settings
from service.storage import clock
from service.storage.tables import Alert, AlertDelivery, as_utc, iso_time, utcnow

ERROR_CHARS = 200  # of a receiver's error, kept and shown: the status and a short reason
ICONS = {"firing": ":rotating_light:", "resolved": ":white_check_mark:"}


def alert_document(alert: Alert, run: str) -> AlertDocument:
    """An alert as receivers and the API see it."""
    return from_row(AlertDocument, alert, run=run, step=alert.last_step)


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
        delivery.next_attempt_at = clock.db_time()
    return out


def delivery_status(delivery: AlertDelivery) -> DeliveryStatus:
    """A notification as reads show it: the receiver by kind and host, its error redacted."""
    last_error = redacted_error(delivery.last_error, delivery.url) if delivery.last_error else None
    return from_row(DeliveryStatus, delivery, url=redacted_url(delivery.url), last_error=last_error)


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
