"""Migrations up and down on both databases, and the tables match the models exactly."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

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
