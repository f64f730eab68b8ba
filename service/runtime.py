"""The loops a process runs beside its requests: the scoring worker, the alert dispatcher, the payload purger.

One ``Background`` serves both composition roots: ``create_app``'s lifespan (worker in a thread when embedded,
dispatcher, purger) and the ``worker`` command (dispatcher only; the worker runs in the foreground).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

import httpx
from sqlalchemy.orm import Session, sessionmaker

from service.alerts.dispatcher import Dispatcher
from service.jobs.retention import Purger
from service.loops import start_in_thread
from service.settings import Settings

Loop = Callable[[threading.Event], None]


class Background:
    """Starts its loops on ``with`` entry and on exit stops them, waits up to ``join_seconds`` each, closes HTTP.

    ``worker`` is a scoring loop to run in a thread (None: the caller scores, or nothing does); ``purge`` says
    whether this process runs payload retention (only when ``payload_retention_days`` is set).
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        settings: Settings,
        *,
        worker: Loop | None,
        purge: bool,
        join_seconds: float = 60,
    ) -> None:
        self.sessions, self.settings = sessions, settings
        self.worker, self.purge, self.join_seconds = worker, purge, join_seconds
        self.threads: list[tuple[threading.Thread, threading.Event]] = []
        self.http: httpx.Client | None = None

    def __enter__(self) -> Background:
        if self.worker is not None:
            self.threads.append(start_in_thread(self.worker, "collapse-monitor-worker"))
        self.http = httpx.Client()
        dispatcher = Dispatcher(self.sessions, self.settings, self.http)
        self.threads.append(start_in_thread(dispatcher.run, "collapse-monitor-alerts"))
        if self.purge and self.settings.payload_retention_days is not None:
            purger = Purger(self.sessions, self.settings.payload_retention_days)
            self.threads.append(start_in_thread(purger.run, "collapse-monitor-retention"))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for _, stop in self.threads:
            stop.set()
        for thread, _ in self.threads:
            thread.join(timeout=self.join_seconds)
        self.threads.clear()
        if self.http is not None:
            self.http.close()
            self.http = None
