"""Documentation generated from code stays in sync with it."""

from __future__ import annotations

from pathlib import Path

from service.metrics import catalogue_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_the_metric_catalogue_is_generated_from_the_exported_metrics():
    assert (ROOT / "docs" / "metrics.md").read_text() == catalogue_markdown()
