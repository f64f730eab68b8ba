"""service/alerts/notifications.py and dispatcher.py offline: what each receiver is sent, the retry schedule."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from service.alerts.dispatcher import retry_delay
from service.alerts.notifications import alert_document, alertmanager_alert, notifications
from service.settings import Settings
from service.storage.tables import Alert


def settings(**values) -> Settings:
    return Settings(_env_file=None, **values)


def alert(state: str = "firing") -> Alert:
    return Alert(
        id=7,
        run_id=1,
        sampler="first_turn",
        rule="TemplateCollapse",
        severity="critical",
        state=state,
        onset_step=10,
        fired_step=12,
        resolved_step=None,
        last_step=13,
        value=0.01,
        baseline=0.5,
        threshold=0.3,
        summary="TemplateCollapse on run ppo-7",
        description="what to do",
        created_at=datetime(2026, 12, 1, 10, 0, tzinfo=UTC),
    )


def test_every_configured_receiver_is_owed_one_pending_notification():
    owed = notifications(
        alert(),
        "ppo-7",
        "firing",
        settings(
            alert_webhooks=["http://a/hook", "http://b/hook"],
            alert_slack_webhooks=["http://slack/x"],
            alertmanager_url="http://am:9093/",
        ),
    )
    assert [(d.receiver, d.url) for d in owed] == [
        ("webhook", "http://a/hook"),
        ("webhook", "http://b/hook"),
        ("slack", "http://slack/x"),
        ("alertmanager", "http://am:9093/api/v2/alerts"),
    ]
    assert {(d.status, d.attempts, d.event) for d in owed} == {("pending", 0, "firing")}
    assert notifications(alert(), "ppo-7", "firing", settings()) == []


def test_the_webhook_carries_the_alert_document_and_slack_one_line():
    webhook, slack = notifications(
        alert(), "ppo-7", "firing", settings(alert_webhooks=["http://a"], alert_slack_webhooks=["http://s"])
    )
    assert webhook.payload == {
        "version": 1,
        "event": "firing",
        "alert": alert_document(alert(), "ppo-7").model_dump(mode="json"),
    }
    assert webhook.payload["alert"]["step"] == 13
    assert webhook.payload["alert"]["run"] == "ppo-7"
    assert slack.payload == {
        "text": ":rotating_light: *TemplateCollapse* (critical) firing on run `ppo-7`: TemplateCollapse on run ppo-7"
    }


def test_alertmanager_gets_labels_an_end_time_and_a_link_back():
    firing = alertmanager_alert(alert(), "ppo-7", "firing", "https://monitor.example/")
    assert firing["labels"] == {
        "alertname": "TemplateCollapse",
        "severity": "critical",
        "run": "ppo-7",
        "sampler": "first_turn",
        "service": "collapse-monitor",
    }
    assert firing["startsAt"] == "2026-12-01T10:00:00+00:00"
    ends = datetime.fromisoformat(firing["endsAt"])
    assert timedelta(minutes=59) < ends - datetime.now(UTC) <= timedelta(hours=1)  # refreshed every scored step
    assert firing["generatorURL"] == "https://monitor.example/v1/runs/ppo-7/alerts"
    resolved = alertmanager_alert(alert("resolved"), "ppo-7", "resolved", "")
    assert datetime.fromisoformat(resolved["endsAt"]) <= datetime.now(UTC)
    assert resolved["generatorURL"] == ""


@pytest.mark.parametrize(("attempts", "seconds"), [(1, 2.0), (2, 4.0), (3, 8.0), (6, 50.0), (12, 50.0)])
def test_retries_back_off_exponentially_up_to_the_cap(attempts, seconds):
    assert retry_delay(attempts, settings(delivery_backoff_seconds=2.0, delivery_backoff_max_seconds=50.0)) == seconds
