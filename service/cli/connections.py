"""The connections `serve` accepts: uvicorn's options from Settings, deadlines on a request's head and
body and on an answer the client stopped reading, and one log line per kind of refusal.

uvicorn (0.55, h11) closes a connection only once it has answered on it and it stayed idle: one that
opened and sent nothing, or a head or body a byte a second, was held for ever (50 of 50 after 120 s),
and with a lowered descriptor limit 150 of them kept every other client out while asyncio logged
421,790 tracebacks in 32 s. An answer its client stopped reading (its socket buffers full) was held as
long as the client stayed, with the rest of the answer in memory (8 clients asking for an 8.3 MB series and
reading nothing: all 8 held after 30 s, +27 MB each). Must not import fastapi.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("collapse_monitor.connections")


@dataclass(frozen=True)
class ConnectionLimits:
    """The slice of Settings that bounds connections (docs/settings.md says what each means)."""

    forwarded_allow_ips: tuple[str, ...]
    max_connections: int
    keep_alive_seconds: int
    request_head_seconds: float
    request_body_seconds: float
    response_stall_seconds: float

    @classmethod
    def of(cls, settings: Any) -> ConnectionLimits:
        return cls(
            tuple(settings.forwarded_allow_ips),
            settings.max_connections,
            settings.keep_alive_seconds,
            settings.request_head_seconds,
            settings.request_body_seconds,
            settings.response_stall_seconds,
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.run`` keywords: proxy headers only from the listed proxies, the concurrency cap, the protocol."""
        return {
            "proxy_headers": bool(self.forwarded_allow_ips),
            "forwarded_allow_ips": list(self.forwarded_allow_ips) or None,
            "limit_concurrency": self.max_connections,
            "timeout_keep_alive": self.keep_alive_seconds,
            "http": deadline_protocol(
                self.request_head_seconds, self.request_body_seconds, self.response_stall_seconds
            ),
        }


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head or body is not in by its deadline, or
    whose answer stayed stalled (the transport's buffer full: the client reads nothing) ``stall_seconds``."""

    head_seconds: ClassVar[float]
    body_seconds: ClassVar[float]
    stall_seconds: ClassVar[float]
    _deadline: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float, part: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire, part, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, part: str, seconds: float) -> None:
        self._deadline = None
        if part == "answer":
            # close() would wait for the buffer to drain, which is what the client never lets happen.
            log.warning(
                "dropped a connection whose client read none of its answer for %s s (response_stall_seconds)",
                seconds,
            )
            self.transport.abort()
        elif not self.transport.is_closing():
            # The part is in the message itself: OncePerKind tells kinds apart by it.
            log.warning(
                f"closed a connection whose request {part} was not in after %s s (request_{part}_seconds)", seconds
            )
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
        super().connection_made(transport)
        self._arm(self.head_seconds, "head")

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not before:  # a request's head is in
            self._disarm()
            if cycle.more_body:
                self._arm(self.body_seconds, "body")
        elif cycle is not None and not cycle.more_body and self._deadline is not None:
            self._disarm()  # its body is in: the answer is the app's to give

    def pause_writing(self) -> None:  # the transport's buffer is full: the client is not reading
        super().pause_writing()
        self._arm(self.stall_seconds, "answer")

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._deadline is not None:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm(self.head_seconds, "head")  # the next request's; keep-alive may close it sooner

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def deadline_protocol(head_seconds: float, body_seconds: float, stall_seconds: float) -> type[H11Protocol]:
    """``DeadlineH11Protocol`` with these deadlines (uvicorn takes a protocol class, not an instance)."""
    deadlines = {"head_seconds": head_seconds, "body_seconds": body_seconds, "stall_seconds": stall_seconds}
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), deadlines)


class OncePerKind(logging.Filter):
    """Lets a log line through once per ``seconds`` per kind (logger and message template), then says how
    many were held back: a refusal repeated by every hostile connection is one line, not one per event."""

    def __init__(self, seconds: float = 60.0) -> None:
        super().__init__()
        self.seconds = seconds
        self.last: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg))
        now = time.monotonic()
        shown, held = self.last.get(kind, (-self.seconds, 0))
        if now - shown < self.seconds:
            self.last[kind] = (shown, held + 1)
            return False
        self.last[kind] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it held back in the last {self.seconds:.0f} s)"
        return True


# The loggers whose lines a hostile client repeats: uvicorn's refusals, asyncio's accept errors, the deadlines.
REPEATED_LOGGERS = ("uvicorn.error", "asyncio", log.name)


def log_once_per_kind(seconds: float = 60.0) -> None:
    once = OncePerKind(seconds)
    for name in REPEATED_LOGGERS:
        logging.getLogger(name).addFilter(once)
