"""The Prometheus rules and the Alertmanager example pass the real promtool and amtool."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import need

pytestmark = pytest.mark.integration
RULES = Path(__file__).resolve().parents[2] / "dashboards" / "prometheus"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, cwd=RULES, check=False)


def test_promtool_accepts_the_rules():
    result = run(need("promtool"), "check", "rules", "collapse-rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def test_each_rule_fires_on_a_collapsing_series_and_stays_silent_on_a_healthy_one():
    result = run(need("promtool"), "test", "rules", "collapse-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_amtool_accepts_the_example_alertmanager_config():
    result = run(need("amtool"), "check-config", "alertmanager.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_rules_only_use_metrics_the_service_exports():
    from service.metrics import catalogue_markdown

    names = re.compile(r"collapse_monitor_[a-z0-9_]+")
    exported = set(names.findall(catalogue_markdown()))
    used = set(names.findall((RULES / "collapse-rules.yml").read_text()))
    assert used
    assert used <= exported, used - exported
