"""The alert dispatcher: leases due notifications from the outbox, POSTs them, retries with backoff.

On failure a notification is retried with exponential backoff (``delivery_backoff_seconds``
doubling up to ``delivery_backoff_max_seconds``); after ``delivery_max_attempts`` it is marked
failed, kept with its last error, and counted.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from service.alerts.notifications import redacted_error, redacted_url
from service.loops import Backoff, owner_id, poll, retry_through_outage
from service.settings import Settings
from service.storage import alerts

log = logging.getLogger("collapse_monitor.alert_delivery")
# httpx's timeout of each phase of a POST (connect, write, read, a free connection); a response's
# body is read only as far as ERROR_BYTES, so one send takes at most about 3 x this.
SEND_TIMEOUT_SECONDS = 10.0
ERROR_BYTES = 1024
# The lease of one notification, taken just before it is sent: it must outlast one send (about
# 30 s, above) and the recording of its outcome, or another dispatcher would send it too. A
# dispatcher that dies mid-send: its notification is sent again after this (at least once).
LEASE_SECONDS = 2 * 3 * SEND_TIMEOUT_SECONDS


def retry_delay(attempts: int, settings: Settings) -> float:
    """Seconds before the next try after ``attempts`` failed ones: doubling from the first delay, capped.

    No jitter: a notification's schedule is the documented one, and each is retried on its own.
    """
    return Backoff(settings.delivery_backoff_seconds, settings.delivery_backoff_max_seconds).delay(attempts)


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
                    for d in alerts.claim_deliveries(session, self.owner, LEASE_SECONDS, 1)
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
            if not alerts.record_delivery(
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
