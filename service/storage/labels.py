"""Sampler labels of stored series that no scorer writes. Imports no SQLAlchemy (the wire schemas use them)."""

from __future__ import annotations

TRAINER = "trainer"  # figures a trainer computed itself and sent (service.ingest.figures): never scored nor alerted on
