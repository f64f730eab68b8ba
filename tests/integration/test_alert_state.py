"""Alerts end to end inside the service: rules on stored series, states, and delivery to real receivers."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.fixtures import dependence_matrix

pytestmark = pytest.mark.integration


class Receiver:
    """An HTTP receiver on loopback that records every POST and fails the first ``failures``."""

    def __init__(self, failures: int = 0) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.failures = failures
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                receiver.requests.append((self.path, body))
                failing = len(receiver.requests) <= receiver.failures
                self.send_response(500 if failing else 200)
                self.end_headers()
                self.wfile.write(b"boom" if failing else b"ok")

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(failures: int = 0) -> Receiver:
        made.append(Receiver(failures))
        return made[-1]

    yield make
    for r in made:
        r.close()


def feed(client, run, dependences, sampler="matrix", start=1):
    for i, dependence in enumerate(dependences):
        body = dependence_matrix(start + i, dependence) | {"sampler": sampler}
        assert client.post(f"/v1/runs/{run}/matrices", json=body).status_code == 201


def wait_for_deliveries(client, count, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        deliveries = [d for a in client.get("/v1/alerts").json() for d in a["deliveries"]]
        if len(deliveries) >= count and all(d["status"] in ("delivered", "failed") for d in deliveries):
            return deliveries
        time.sleep(0.05)
    raise AssertionError(f"deliveries did not settle: {deliveries}")


def test_template_collapse_fires_and_resolves_with_notifications_to_json_and_slack(database_url, client_for, receiver):
    hooks = receiver()
    client = client_for(
        database_url,
        scoring_paused=True,
        alert_webhooks=[hooks.url + "/json"],
        alert_slack_webhooks=[hooks.url + "/slack"],
    )
    client.post("/v1/runs", json={"name": "ppo", "alerts": {"signal": "mi_estimate", "window": 3}})
    feed(client, "ppo", [1.5] * 5 + [0.0] * 4 + [1.5] * 3)
    (alert,) = client.get("/v1/runs/ppo/alerts").json()
    assert (alert["rule"], alert["state"], alert["severity"]) == ("TemplateCollapse", "resolved", "critical")
    assert (alert["onset_step"], alert["fired_step"], alert["resolved_step"]) == (6, 8, 11)
    assert alert["summary"].startswith("TemplateCollapse on run ppo (matrix) at step")
    deliveries = wait_for_deliveries(client, 4)
    assert sorted((d["receiver"], d["event"], d["status"]) for d in deliveries) == [
        ("slack", "firing", "delivered"),
        ("slack", "resolved", "delivered"),
        ("webhook", "firing", "delivered"),
        ("webhook", "resolved", "delivered"),
    ]
    by_path: dict[str, list] = {}
    for path, body in hooks.requests:
        by_path.setdefault(path, []).append(body)
    firing = by_path["/json"][0]
    assert (firing["version"], firing["event"]) == (1, "firing")
    assert firing["alert"]["run"] == "ppo"
    assert firing["alert"]["fired_step"] == 8
    assert [b["event"] for b in by_path["/json"]] == ["firing", "resolved"]
    assert by_path["/slack"][0]["text"].startswith(":rotating_light: *TemplateCollapse* (critical) firing on run `ppo`")


def test_a_healthy_run_raises_nothing(database_url, client_for, receiver):
    hooks = receiver()
    client = client_for(database_url, scoring_paused=True, alert_webhooks=[hooks.url])
    client.post("/v1/runs", json={"name": "fine"})
    feed(client, "fine", [1.5] * 12)
    assert client.get("/v1/alerts").json() == []
    assert hooks.requests == []


def test_failed_deliveries_are_retried_with_backoff_and_recorded(database_url, client_for, receiver):
    flaky = receiver(failures=2)
    client = client_for(database_url, scoring_paused=True, alert_webhooks=[flaky.url], delivery_backoff_seconds=0.05)
    client.post("/v1/runs", json={"name": "r", "alerts": {"signal": "mi_estimate", "window": 3}})
    feed(client, "r", [1.5] * 5 + [0.0] * 3)
    (delivery,) = wait_for_deliveries(client, 1)
    assert (delivery["status"], delivery["attempts"], delivery["last_error"]) == ("delivered", 3, None)
    assert len(flaky.requests) == 3


def test_a_receiver_that_never_answers_is_marked_failed_not_dropped(database_url, client_for, receiver):
    dead = receiver(failures=1000)
    client = client_for(
        database_url,
        scoring_paused=True,
        alert_webhooks=[dead.url],
        delivery_backoff_seconds=0.01,
        delivery_max_attempts=3,
    )
    client.post("/v1/runs", json={"name": "r", "alerts": {"signal": "mi_estimate", "window": 3}})
    feed(client, "r", [1.5] * 5 + [0.0] * 3)
    (delivery,) = wait_for_deliveries(client, 1)
    assert (delivery["status"], delivery["attempts"]) == ("failed", 3)
    assert delivery["last_error"] == "HTTP 500: boom"
    metrics = client.get("/metrics").text
    assert 'collapse_monitor_alert_deliveries{receiver="webhook",status="failed"} 1.0' in metrics
    firing = 'rule="TemplateCollapse",run="r",sampler="matrix",severity="critical",state="firing"'
    assert f"collapse_monitor_alerts{{{firing}}} 1.0" in metrics


def test_alerts_can_be_filtered_by_state_rule_and_run(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    client.post("/v1/runs", json={"name": "a", "alerts": {"signal": "mi_estimate", "window": 3}})
    client.post("/v1/runs", json={"name": "b"})
    feed(client, "a", [1.5] * 5 + [0.0] * 3)
    feed(client, "b", [1.5] * 8)
    assert [a["run"] for a in client.get("/v1/alerts", params={"state": "firing"}).json()] == ["a"]
    assert client.get("/v1/alerts", params={"rule": "EntropyCollapse"}).json() == []
    assert client.get("/v1/runs/b/alerts").json() == []
    missing = client.get("/v1/alerts", params={"run": "zzz"})
    assert missing.status_code == 404
    bad = client.get("/v1/alerts", params={"state": "exploded"})
    assert bad.status_code == 422


def test_a_pending_alert_whose_condition_breaks_is_kept_as_a_dropped_record_and_notifies_nobody(
    database_url, client_for, receiver
):
    hooks = receiver()
    client = client_for(database_url, scoring_paused=True, alert_webhooks=[hooks.url])
    client.post("/v1/runs", json={"name": "r", "alerts": {"signal": "mi_estimate", "window": 3}})
    feed(client, "r", [1.5] * 5 + [0.0] * 2)
    (pending,) = client.get("/v1/runs/r/alerts").json()
    assert (pending["state"], pending["onset_step"]) == ("pending", 6)
    feed(client, "r", [1.5] * 2, start=8)  # the condition broke before it held 3 steps
    assert client.get("/v1/runs/r/alerts").json() == []  # nothing to act on
    (dropped,) = client.get("/v1/runs/r/alerts", params={"state": "dropped"}).json()
    assert dropped["id"] == pending["id"]
    assert (dropped["state"], dropped["onset_step"], dropped["fired_step"], dropped["step"]) == ("dropped", 6, None, 7)
    assert dropped["value"] < dropped["threshold"]  # its figures at its last held step
    assert "fell below" in dropped["summary"]
    assert hooks.requests == []
    assert 'state="dropped"' not in client.get("/metrics").text
