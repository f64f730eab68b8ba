"""Alerts reach a real Alertmanager (Debian's prometheus-alertmanager 0.25) and resolve there."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.serving import alertmanager_alerts, free_port, wait_until
from tests.e2e.conftest import need, service_env, start_service
from tests.fixtures import dependence_matrix

pytestmark = pytest.mark.e2e


def test_a_collapse_alert_arrives_in_alertmanager_and_resolves(processes, tmp_path):
    binary = need("prometheus-alertmanager")
    port = free_port()
    config = tmp_path / "alertmanager.yml"
    config.write_text("route: {receiver: 'null'}\nreceivers: [{name: 'null'}]\n")
    processes.start(
        "alertmanager",
        [
            binary,
            f"--config.file={config}",
            f"--storage.path={tmp_path / 'am'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
    )
    manager = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{manager}/-/ready").status_code == 200, 30, "Alertmanager")
    env = service_env(
        tmp_path,
        COLLAPSE_MONITOR_ALERTMANAGER_URL=manager,
        COLLAPSE_MONITOR_SCORING_PAUSED="true",
        COLLAPSE_MONITOR_PUBLIC_URL="http://monitor.example",
        COLLAPSE_MONITOR_ALERT_WEBHOOKS=json.dumps([]),
    )
    base = start_service(processes, env)
    with httpx.Client(base_url=base) as http:
        http.post("/v1/runs", json={"name": "am-run", "alerts": {"signal": "mi_estimate", "window": 3}})
        for step, dependence in enumerate([1.5] * 5 + [0.0] * 3, start=1):
            assert http.post("/v1/runs/am-run/matrices", json=dependence_matrix(step, dependence)).status_code == 201

    (alert,) = alertmanager_alerts(manager, 30)
    assert alert["labels"] == {
        "alertname": "TemplateCollapse",
        "severity": "critical",
        "run": "am-run",
        "sampler": "matrix",
        "service": "collapse-monitor",
    }
    assert alert["annotations"]["summary"].startswith("TemplateCollapse on run am-run (matrix) at step 8")
    assert alert["generatorURL"] == "http://monitor.example/v1/runs/am-run/alerts"
    assert alert["status"]["state"] == "active"

    with httpx.Client(base_url=base) as http:
        for step in (9, 10):
            http.post("/v1/runs/am-run/matrices", json=dependence_matrix(step, 1.5))
    wait_until(lambda: httpx.get(f"{manager}/api/v2/alerts").json() == [], 30, "the alert to resolve in Alertmanager")
    deliveries = httpx.get(f"{base}/v1/runs/am-run/alerts").json()[0]["deliveries"]
    assert {(d["receiver"], d["event"], d["status"]) for d in deliveries} >= {
        ("alertmanager", "firing", "delivered"),
        ("alertmanager", "resolved", "delivered"),
    }
