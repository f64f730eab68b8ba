"""Migrations up and down on both databases, and the tables match the models exactly."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from service.storage.database import make_engine, migrate
from service.storage.tables import Base

pytestmark = pytest.mark.integration
TABLES = {
    "runs",
    "batches",
    "metric_points",
    "latest_metrics",
    "checkpoints",
    "ema_states",
    "alerts",
    "alert_deliveries",
    "score_matrices",
    "api_tokens",
}


def tables(url) -> set[str]:
    engine = make_engine(url)
    names = set(inspect(engine).get_table_names())
    engine.dispose()
    return names - {"alembic_version"}


def test_migrations_go_up_down_and_up_again(empty_database_url):
    migrate(empty_database_url)
    assert tables(empty_database_url) >= TABLES
    migrate(empty_database_url, "base")
    assert tables(empty_database_url) == set()
    migrate(empty_database_url)
    assert tables(empty_database_url) >= TABLES


def test_the_migrated_schema_matches_the_models(database_url):
    migrate(database_url)
    engine = make_engine(database_url)
    with engine.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    engine.dispose()
    assert differences == []


def test_runs_payload_bytes_is_filled_from_the_payloads_already_stored(empty_database_url):
    migrate(empty_database_url, "0011")
    engine = make_engine(empty_database_url)
    payload = '{"prompt": "né"}'  # 17 bytes, 16 characters
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO runs (id, name, details, scorer, scorer_mode, score_every, samplers, seed, temperature, "
                "filter, alert_rules, reasoning_extraction, created_at, segment) VALUES (1, 'r', '{}', 's', "
                "'reference', 1, '[]', 0, 1.0, '{}', '{}', 'auto', CURRENT_TIMESTAMP, 0)"
            )
        )
        for i in range(2):
            connection.execute(
                text(
                    "INSERT INTO batches (id, run_id, step, segment, kind, payload, payload_sha256, status, attempts, "
                    "created_at) VALUES (:id, 1, :step, 0, 'rollouts', :payload, '', 'done', 0, CURRENT_TIMESTAMP)"
                ),
                {"id": f"b{i}", "step": i, "payload": payload},
            )
    migrate(empty_database_url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT payload_bytes FROM runs")).scalar() == 2 * len(payload.encode())
    engine.dispose()
