"""service/metrics.py on a fresh registry: what a scrape exports for a given snapshot (read as samples)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from service.metrics import (
    EXPORTED,
    SCORING_SECONDS_BUCKETS,
    DiagnosticsCollector,
    MetricsSnapshot,
    ServiceMetrics,
    SnapshotCache,
    catalogue_markdown,
)

SCORING = {
    "count": 3,
    "sum_seconds": 4.5,
    "tokens": 900,
    "buckets": [0, 0, 0, 0, 1, 2, 3, 3, 3, 3, 3, 3],
    "recent_tokens_per_second": 200.0,
}


def snapshot(**changes) -> MetricsSnapshot:
    values = {
        "latest": [
            ("run-a", "first_turn", "mi_estimate", 0.25, 4),
            ("run-a", "all", "rollout/in_group_reward_std", 0.5, 6),
            ("run-b", "first_turn", "mi_estimate", -0.01, 2),
            ("run-b", "first_turn", "not_exported", 9.0, 2),
        ],
        "batches": {"queued": 2, "scoring": 1, "done": 3, "failed": 1},
        "scoring": SCORING,
        "buckets": SCORING_SECONDS_BUCKETS,
        "alerts": [("run-a", "first_turn", "TemplateCollapse", "critical", "firing")],
        "deliveries": [("alertmanager", "delivered", 2), ("webhook", "failed", 1)],
    }
    return MetricsSnapshot(**(values | changes))


def registry_for(read) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(DiagnosticsCollector(read))
    return registry


def test_latest_values_become_gauges_labelled_by_run_and_sampler():
    registry = registry_for(snapshot)
    get = registry.get_sample_value
    assert get("collapse_monitor_mi_estimate_nats", {"run": "run-a", "sampler": "first_turn"}) == 0.25
    assert get("collapse_monitor_mi_estimate_nats", {"run": "run-b", "sampler": "first_turn"}) == -0.01
    assert get("collapse_monitor_reward_std", {"run": "run-a", "sampler": "all"}) == 0.5
    assert get("collapse_monitor_last_step", {"run": "run-a"}) == 6  # the newest step of any of its series
    assert get("collapse_monitor_last_step", {"run": "run-b"}) == 2
    assert "not_exported" not in generate_latest(registry).decode()
    assert get("collapse_monitor_database_up") == 1


def test_service_figures_alerts_and_deliveries_are_exported():
    get = registry_for(snapshot).get_sample_value
    assert get("collapse_monitor_queue_depth") == 2
    assert get("collapse_monitor_batches_in_progress") == 1
    assert get("collapse_monitor_batches_scored_total", {"status": "done"}) == 3
    assert get("collapse_monitor_batches_scored_total", {"status": "failed"}) == 1
    assert get("collapse_monitor_scoring_duration_seconds_count") == 3
    assert get("collapse_monitor_scoring_duration_seconds_sum") == 4.5
    assert get("collapse_monitor_scoring_duration_seconds_bucket", {"le": "1.0"}) == 1
    assert get("collapse_monitor_scoring_duration_seconds_bucket", {"le": "+Inf"}) == 3
    assert get("collapse_monitor_scored_tokens_total") == 900
    assert get("collapse_monitor_scorer_tokens_per_second") == 200
    labels = {"run": "run-a", "sampler": "first_turn", "rule": "TemplateCollapse", "severity": "critical"}
    assert get("collapse_monitor_alerts", labels | {"state": "firing"}) == 1
    assert get("collapse_monitor_alert_deliveries", {"receiver": "webhook", "status": "failed"}) == 1


def test_every_exported_family_is_present_even_before_any_run():
    registry = registry_for(lambda: snapshot(latest=[], alerts=[], deliveries=[]))
    text = generate_latest(registry).decode()
    for exported in EXPORTED:
        assert f"# TYPE collapse_monitor_{exported.name} gauge" in text
    assert (
        registry.get_sample_value("collapse_monitor_mi_estimate_nats", {"run": "run-a", "sampler": "first_turn"})
        is None
    )


def test_an_unreadable_database_exports_database_up_0_and_nothing_else():
    def broken() -> MetricsSnapshot:
        raise ConnectionError("database is down")

    registry = registry_for(broken)
    assert registry.get_sample_value("collapse_monitor_database_up") == 0
    assert registry.get_sample_value("collapse_monitor_queue_depth") is None


def test_request_and_rejection_counters_count_by_label():
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry)
    metrics.requests.labels("POST", "/v1/runs/{run}/batches", "202").inc()
    metrics.requests.labels("POST", "/v1/runs/{run}/batches", "202").inc()
    metrics.rejections.labels("validation").inc()
    get = registry.get_sample_value
    assert (
        get("collapse_monitor_requests_total", {"method": "POST", "route": "/v1/runs/{run}/batches", "status": "202"})
        == 2
    )
    assert get("collapse_monitor_rejections_total", {"reason": "validation"}) == 1
    assert get("collapse_monitor_rejections_total", {"reason": "not_found"}) is None


@pytest.mark.parametrize("exported", EXPORTED, ids=lambda e: e.name)
def test_exported_names_follow_prometheus_conventions_and_are_catalogued(exported):
    assert exported.name == exported.name.lower()
    assert ":" not in exported.name
    assert not exported.name.endswith("_total")
    assert f"`collapse_monitor_{exported.name}`" in catalogue_markdown()


def test_series_beyond_the_cap_are_left_out_whole_runs_at_a_time_and_counted():
    latest = [
        ("new", "first_turn", "mi_estimate", 1.0, 9),
        ("new", "first_turn", "retrieval_accuracy", 0.5, 9),
        ("old", "first_turn", "mi_estimate", 2.0, 3),
        ("old", "all", "reward_mean", 0.1, 3),
    ]
    registry = CollectorRegistry()
    registry.register(DiagnosticsCollector(lambda: snapshot(latest=latest), max_series=4))
    get = registry.get_sample_value
    assert get("collapse_monitor_mi_estimate_nats", {"run": "new", "sampler": "first_turn"}) == 1.0
    assert get("collapse_monitor_mi_estimate_nats", {"run": "old", "sampler": "first_turn"}) is None
    assert get("collapse_monitor_last_step", {"run": "old"}) is None
    assert get("collapse_monitor_series_dropped") == 3  # old's two gauges and its last_step


class Clock:
    """The one external thing the cache depends on, advanced by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_snapshot_cache_reads_once_per_period_and_never_keeps_a_failure():
    clock = Clock()
    answers: list[MetricsSnapshot | Exception] = [snapshot(), RuntimeError("down"), snapshot(batches={"queued": 7})]

    def read() -> MetricsSnapshot:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    cache = SnapshotCache(read, seconds=5.0, clock=clock)
    registry = registry_for(cache)
    for _ in range(10):
        assert registry.get_sample_value("collapse_monitor_queue_depth") == 2
    assert cache.reads == 1
    clock.now += 5.0
    assert registry.get_sample_value("collapse_monitor_database_up") == 0  # read again, and it failed
    assert registry.get_sample_value("collapse_monitor_queue_depth") == 7  # not kept: the next scrape reads
    assert cache.reads == 2


def test_a_database_outage_is_logged_when_it_starts_and_when_it_ends(caplog):
    down = {"now": True}

    def read() -> MetricsSnapshot:
        if down["now"]:
            raise ConnectionError("connection refused")
        return snapshot()

    registry = CollectorRegistry()
    registry.register(DiagnosticsCollector(read, outage=lambda e: f"unreachable: {e}"))
    with caplog.at_level("INFO", logger="collapse_monitor.metrics"):
        for _ in range(30):
            generate_latest(registry)
        down["now"] = False
        generate_latest(registry)
        generate_latest(registry)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        "reading metrics: unreachable: connection refused; /metrics answers database_up 0 until it answers again"
    )
    assert lines[1].startswith("reading metrics: the database answers again after 30 failed scrapes in ")
    assert len(lines) == 2
    assert all(r.exc_info is None for r in caplog.records)  # no traceback for an outage


def test_a_failure_that_is_not_an_outage_is_logged_with_its_traceback_once(caplog):
    def read() -> MetricsSnapshot:
        raise KeyError("bug")

    registry = registry_for(read)
    with caplog.at_level("INFO", logger="collapse_monitor.metrics"):
        for _ in range(5):
            generate_latest(registry)
    assert len(caplog.records) == 1
    assert caplog.records[0].exc_info is not None
