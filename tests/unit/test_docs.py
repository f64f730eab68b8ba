"""Documentation generated from code stays in sync with it."""

from __future__ import annotations

from pathlib import Path

from service.alerts.rules import settings_table
from service.metrics import catalogue_markdown
from service.settings import Settings, settings_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_the_metric_catalogue_is_generated_from_the_exported_metrics():
    assert (ROOT / "docs" / "metrics.md").read_text() == catalogue_markdown()


def test_the_alert_settings_table_is_generated_from_the_settings_model():
    text = (ROOT / "docs" / "alerts.md").read_text()
    table = text.split("<!-- alert settings: generated -->\n", 1)[1].split("<!-- end of alert settings -->", 1)[0]
    assert table == settings_table()


def test_the_settings_table_is_generated_from_settings_and_names_every_field():
    text = (ROOT / "docs" / "settings.md").read_text()
    assert text == settings_markdown()
    for name in Settings.model_fields:
        assert f"| `{name}` | `COLLAPSE_MONITOR_{name.upper()}` |" in text
    assert str(Path.home()) not in text  # no path of the machine that generated it
