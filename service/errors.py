"""The service's exceptions and the one place they become HTTP responses.

    MonitorError                 every error the service raises on purpose
    ├── ClientError              the request is at fault (4xx); counted by reason
    │   ├── InvalidRequest       400  well-formed but inconsistent (shapes, unknown scorer, paths)
    │   │   └── UntrustedHost    400  a Host header the service does not answer to (allowed_hosts)
    │   ├── Unauthorized         401  no bearer token where one is needed
    │   │   ├── InvalidToken     401  a token this service never issued
    │   │   └── RevokedToken     401  a token that was revoked
    │   ├── Forbidden            403  a valid token whose scope or run prefix does not allow this
    │   │   ├── RunLimitReached  403  an ingest token that created ``max_runs_per_token`` runs
    │   │   └── ForeignOrigin    403  a state-changing request from a browser page of another origin
    │   ├── NotFound             404  unknown run or batch
    │   ├── Conflict             409  an idempotency_key sent again with different content
    │   │   ├── RunConflict      409  a run name re-created with different settings
    │   │   ├── FigureConflict   409  a trainer figure of a step sent again with another value
    │   │   └── StepConflict     409  a matrix step that went back while a later one was stored concurrently
    │   ├── TooLarge             413  body or batch over the configured limits (sizes, scoring cost)
    │   │   └── StorageQuota     413  a run whose stored payloads would pass ``max_stored_bytes_per_run``
    │   └── TooManyRequests      429  a client over its request rate; retry after ``retry_after`` seconds
    │       ├── RunQueueFull     429  a run with too many batches waiting; retry after ``retry_after``
    │       └── TokenQueueFull   429  the runs of one token with too many batches waiting; likewise
    ├── StorageFull              507  the database's disk is full: writes refused until space is freed
    └── Unavailable              503  the shared queue is full; retry after ``retry_after`` seconds
        ├── ParsingBusy          503  other bodies being parsed hold ``max_parsing_bytes``; retry shortly
        ├── ReadsBusy            503  ``SERIES_READERS`` long series reads are being read already; retry shortly
        └── DatabaseUnavailable  503  the database refused, timed out or dropped the connection

Any other exception answers 500 ``internal_error`` in the same shape (``service.api.middleware``).
Every error renders as ``{"error": code, "detail": what must hold and what was sent,
"field": where, "index": which item}`` (a ``TooLarge`` may add ``limit``, ``allowed`` and ``got``);
``field`` is written as ``field_path`` writes it. An
error with ``retry_after`` also sends a ``Retry-After`` header, the 401s and the scope 403 a
``WWW-Authenticate: Bearer`` one (RFC 6750).
Must not import fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class MonitorError(Exception):
    detail: str
    field: str | None = None
    index: int | None = None
    status = 500
    code = "internal_error"
    challenge: ClassVar[str | None] = None  # the WWW-Authenticate header's value (RFC 6750), if any

    def __str__(self) -> str:
        return self.detail

    def body(self) -> dict[str, object]:
        return {"error": self.code, "detail": self.detail, "field": self.field, "index": self.index}

    def headers(self) -> dict[str, str] | None:
        headers: dict[str, str] = {}
        retry_after = getattr(self, "retry_after", None)
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        if self.challenge is not None:
            headers["WWW-Authenticate"] = self.challenge
        return headers or None


class ClientError(MonitorError):
    status = 400
    code = "invalid_request"


class InvalidRequest(ClientError):
    pass


class Unauthorized(ClientError):
    status = 401
    code = "unauthorized"
    challenge = 'Bearer realm="collapse-monitor"'


class InvalidToken(Unauthorized):
    code = "invalid_token"
    challenge = 'Bearer realm="collapse-monitor", error="invalid_token"'


class RevokedToken(Unauthorized):
    code = "revoked_token"
    challenge = 'Bearer realm="collapse-monitor", error="invalid_token", error_description="revoked"'


class Forbidden(ClientError):
    status = 403
    code = "insufficient_scope"
    challenge: ClassVar[str | None] = 'Bearer realm="collapse-monitor", error="insufficient_scope"'


class RunLimitReached(Forbidden):
    code = "run_limit"
    challenge = None  # not a scope problem: another token's scope would not change the answer


class UntrustedHost(InvalidRequest):
    code = "untrusted_host"


class ForeignOrigin(Forbidden):
    code = "foreign_origin"
    challenge = None  # refused for the page it came from, whatever token it carries


class NotFound(ClientError):
    status = 404
    code = "not_found"


class Conflict(ClientError):
    status = 409
    code = "batch_id_conflict"


class RunConflict(Conflict):
    code = "run_conflict"


class FigureConflict(Conflict):
    code = "figure_conflict"


class StepConflict(Conflict):
    code = "step_conflict"


@dataclass
class TooLarge(ClientError):
    """``limit``, ``allowed`` and ``got`` (the setting, its value, what was sent) where a client can act on
    them: the trainer's client refits a batch to the scoring cost (which it cannot compute without the run's
    samplers) and to each batch limit (which it learns from ``POST /v1/runs`` but may have fitted to before)."""

    limit: str | None = None
    allowed: int | None = None
    got: int | None = None
    status = 413
    code = "too_large"

    def body(self) -> dict[str, object]:
        extra = {"limit": self.limit, "allowed": self.allowed, "got": self.got} if self.limit is not None else {}
        return super().body() | extra


class StorageQuota(TooLarge):
    code = "storage_quota"


@dataclass
class TooManyRequests(ClientError):
    retry_after: int = 1
    status = 429
    code = "rate_limited"


class RunQueueFull(TooManyRequests):
    code = "run_queue_full"


class TokenQueueFull(TooManyRequests):
    code = "token_queue_full"


@dataclass
class Unavailable(MonitorError):
    retry_after: int = 5
    status = 503
    code = "queue_full"


@dataclass
class ParsingBusy(Unavailable):
    """Request bodies being parsed already hold the parsing budget: nothing of this request was kept."""

    retry_after: int = 1
    code = "parsing_busy"


@dataclass
class ReadsBusy(Unavailable):
    """Other long series reads hold their share of the database connections; retry shortly."""

    retry_after: int = 1
    code = "reads_busy"


@dataclass
class StorageFull(MonitorError):
    """The database's disk is full: nothing of the request was kept; reads still work."""

    status = 507
    code = "storage_full"


@dataclass
class DatabaseUnavailable(Unavailable):
    """The database cannot be reached or did not answer in time: retryable, nothing of the request kept.

    A request that wrote nothing before the failure wrote nothing at all (one transaction), so
    the client retries it as is; a replay of one whose commit did land is recognized as a replay.
    """

    retry_after: int = 2
    code = "database_unavailable"


REQUEST_LOCATIONS = ("body", "query", "path", "header", "cookie")


def field_path(loc: Sequence[object]) -> str:
    """Where in a request a value sits, from pydantic's location.

    ``('body', 'trajectories', 3, 'turns', 0, 'reasoning')`` -> ``trajectories[3].turns[0].reasoning``.
    Only the leading part says where in the request (FastAPI's body, query, path, header, cookie):
    later parts are field names, and a field may well be called ``path`` (a checkpoint's).
    """
    parts = list(loc[1:]) if len(loc) > 1 and loc[0] in REQUEST_LOCATIONS else list(loc)
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")


def rejection_reasons() -> list[str]:
    """Every reason a refusal is counted under, so each series exists (at 0) from the first scrape.

    The codes of the 4xx/503/507 errors, plus the refusals made outside them: schema validation, a
    body over the size limit, and the web framework's own (unknown route, wrong method).
    """
    codes = {"validation", "body_too_large", "not_found", "method_not_allowed", "invalid_request"}
    pending: list[type[MonitorError]] = [MonitorError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if 400 <= cls.status < 500 or cls.status in (503, 507):
            codes.add(cls.code)
    return sorted(codes)
