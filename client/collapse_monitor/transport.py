"""HTTP to the service, and what each answer means for a request: done, retry later, or refused.

Owns the status-code policy: 2xx done; connection errors, timeouts, 408, 425, 429 and 5xx retried
(honouring ``Retry-After``); a 404 naming the run means the run must be created again; 401 and 403
mean the token is missing, wrong or not allowed for this run (every later request would be refused
too, so they wait); any other 4xx is a refusal that retrying cannot fix. Must not import threads or
the spool.
"""

from __future__ import annotations

import email.utils
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from collapse_monitor.version import __version__

RETRIED_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Outcome:
    """What became of one request."""

    kind: str  # "ok" | "retry" | "refused" | "run_missing" | "unauthorized"
    status: int | None = None
    detail: str = ""
    retry_after: float | None = None  # seconds the service asked us to wait
    answer: Any = None  # the decoded JSON body, when there is one

    @property
    def error(self) -> dict[str, Any]:
        """The reason kept beside a refused request."""
        return {"status": self.status, "detail": self.detail, "answer": self.answer}


class Transport:
    """One keep-alive connection to the service; used by a single thread."""

    def __init__(self, url: str, timeout: float, headers: dict[str, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            headers={"user-agent": f"collapse-monitor-client/{__version__}", **(headers or {})},
        )

    def post(self, path: str, body: bytes) -> Outcome:
        try:
            response = self._client.post(path, content=body, headers={"content-type": "application/json"})
        except httpx.TransportError as e:
            return Outcome("retry", detail=f"{type(e).__name__}: {e or 'no detail'}")
        return classify(response)

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """The decoded JSON answer of a GET; raises httpx.HTTPError when there is none."""
        response = self._client.get(path, params={k: v for k, v in (params or {}).items() if v is not None})
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._client.close()


def classify(response: httpx.Response) -> Outcome:
    try:
        answer: Any = response.json()
    except ValueError:
        answer = None
    status = response.status_code
    if 200 <= status < 300:
        return Outcome("ok", status, answer=answer)
    detail = _detail(answer) or response.text[:500] or response.reason_phrase
    if status in RETRIED_STATUSES:
        return Outcome("retry", status, f"{status}: {detail}", retry_after_seconds(response.headers), answer)
    if status in (401, 403):
        return Outcome("unauthorized", status, f"{status}: {detail}", answer=answer)
    if status == 404 and isinstance(answer, dict) and answer.get("field") == "run":
        return Outcome("run_missing", status, f"{status}: {detail}", answer=answer)
    return Outcome("refused", status, f"{status}: {detail}", answer=answer)


def limit_passed(outcome: Outcome) -> tuple[str, int, int] | None:
    """(the setting, its value, what was sent) of a 413 naming the service's limit that a request passed
    (``limit``, ``allowed``, ``got``): a batch's scoring cost, which the client cannot know beforehand, or a
    batch limit it fitted the batch to before it knew the service's; None for any other answer."""
    answer = outcome.answer if isinstance(outcome.answer, dict) else {}
    limit, allowed, got = answer.get("limit"), answer.get("allowed"), answer.get("got")
    if outcome.status != 413 or not isinstance(limit, str) or not isinstance(allowed, int):
        return None
    return (limit, allowed, got) if isinstance(got, int) else None


def _detail(answer: Any) -> str:
    if not isinstance(answer, dict):
        return ""
    detail = answer.get("detail")
    if isinstance(detail, list):  # schema errors: one entry per bad field
        return "; ".join(f"{d.get('field') or d.get('loc')}: {d.get('msg')}" for d in detail if isinstance(d, dict))
    if detail is None:
        return json.dumps(answer)[:500]
    return f"{answer.get('error', 'error')}: {detail}"


def retry_after_seconds(headers: httpx.Headers, now: float | None = None) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date); None when absent or unreadable."""
    value = headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, moment.timestamp() - (time.time() if now is None else now))
