"""AppState: what the composition root (``service.app``) builds and the HTTP handlers use.

Its own module so that the routers depend on the state's type, never on the app that builds it.
Must not import fastapi or torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.access import TokenCache
from service.api.rate_limit import BodyBudget
from service.ingest.limits import IngestLimits
from service.metrics import ServiceMetrics
from service.reads.series import SERIES_READERS
from service.settings import Settings
from service.storage.readiness import DatabaseProbe

if TYPE_CHECKING:  # the pool loads torch; API-only processes never build one
    from service.jobs.scorers import ScorerPool


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    registry: CollectorRegistry
    metrics: ServiceMetrics
    tokens: TokenCache
    database_probe: DatabaseProbe
    bodies: BodyBudget  # request bodies being parsed (service.api.deps.AccessFirst)
    ingest_limits: IngestLimits  # what bodies, batches and matrices may hold: the slice of settings ingest reads
    pool: ScorerPool | None = None  # only with an embedded worker
    scorer_ready: threading.Event = field(default_factory=threading.Event)
    scorer_error: str | None = None
    series_reads: threading.BoundedSemaphore = field(default_factory=lambda: threading.BoundedSemaphore(SERIES_READERS))
