"""Sampler labels of stored series that no sampler's matrix gives. Imports no SQLAlchemy (the wire schemas use them)."""

from __future__ import annotations

BATCH = "all"  # figures of the whole batch (rewards, coverage), stored and alerted on beside the samplers'
TRAINER = "trainer"  # figures a trainer computed itself and sent (service.ingest.figures): never scored nor alerted on
