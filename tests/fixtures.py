"""Database and app fixtures (real SQLite and Postgres), shared by the integration and e2e tests.

Each test gets a fresh database (created and dropped here), cloned from one migrated per session
(``empty_database_url`` / ``empty_postgres_url`` for the tests of migrations themselves). Under
CI=true an unreachable Postgres fails the run instead of skipping it.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.orm import Session

from bench import serving
from bench.serving import PG_ADMIN_URL
from service.app import create_app
from service.settings import Settings
from service.storage.database import migrate
from service.storage.tables import MetricPoint


def _postgres_or_skip() -> None:
    try:
        engine = create_engine(PG_ADMIN_URL)
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Postgres at {PG_ADMIN_URL} is unreachable under CI: {e}")
        pytest.skip(f"Postgres at {PG_ADMIN_URL} is unreachable: {e}")


class _Templates:
    """Databases migrated once per session, cloned for each test (10 migrations per item cost minutes)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.sqlite: Path | None = None
        self.postgres: str | None = None

    def sqlite_copy(self, target: Path) -> str:
        if self.sqlite is None:
            self.sqlite = self.folder / "template.db"
            migrate(f"sqlite:///{self.sqlite}")
        shutil.copyfile(self.sqlite, target)
        return f"sqlite:///{target}"

    def postgres_template(self) -> str:
        if self.postgres is None:
            name = _create_postgres_database()
            migrate(serving.postgres_url(name))  # disposes its engines: a template must have no open connection
            self.postgres = name
        return self.postgres


def _create_postgres_database(template: str | None = None) -> str:
    _postgres_or_skip()
    return serving.create_postgres_database("cm_test_", template)


@pytest.fixture(scope="session")
def _templates(tmp_path_factory) -> Iterator[_Templates]:
    templates = _Templates(tmp_path_factory.mktemp("templates"))
    yield templates
    if templates.postgres is not None:
        serving.drop_postgres_database(templates.postgres)


@pytest.fixture
def empty_postgres_url() -> Iterator[str]:
    """A fresh Postgres database with no schema, dropped after the test."""
    name = _create_postgres_database()
    try:
        yield serving.postgres_url(name)
    finally:
        serving.drop_postgres_database(name)


@pytest.fixture
def postgres_url(_templates) -> Iterator[str]:
    """A fresh Postgres database at the head revision (cloned from the session's migrated template)."""
    name = _create_postgres_database(template=_templates.postgres_template())
    try:
        yield serving.postgres_url(name)
    finally:
        serving.drop_postgres_database(name)


@pytest.fixture(params=["sqlite", "postgres"])
def empty_database_url(request, tmp_path) -> str:
    """A fresh database with no schema, on each backend: for the tests of migrations themselves."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'monitor.db'}"
    url: str = request.getfixturevalue("empty_postgres_url")
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request, tmp_path, _templates: _Templates) -> str:
    """A fresh database at the head revision, on each backend."""
    if request.param == "sqlite":
        return _templates.sqlite_copy(tmp_path / "monitor.db")
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def settings_for(tmp_path, monkeypatch):
    """Builds Settings for a test: no environment, no .env, the tiny-random scorer."""
    for key in list(os.environ):
        if key.startswith("COLLAPSE_MONITOR_"):
            monkeypatch.delenv(key)

    def build(database_url: str, **overrides) -> Settings:
        values = {
            "database_url": database_url,
            "data_dir": tmp_path / "data",
            "cache_dir": tmp_path / "cache",
            "default_scorer": "tiny-random",
            "worker_poll_seconds": 0.05,
            "allowed_hosts": ["testserver"],  # the Host header TestClient sends
            "metrics_cache_seconds": 0,  # tests read /metrics right after writing; its cache has tests of its own
        } | overrides
        return Settings(_env_file=None, **values)

    return build


@pytest.fixture
def client_for(settings_for):
    """Starts the app (lifespan included) for given settings; stopped at the end of the test."""
    clients: list[TestClient] = []

    def start(database_url: str, **overrides) -> TestClient:
        client = TestClient(create_app(settings_for(database_url, **overrides)))
        client.__enter__()
        clients.append(client)
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def row_count(url: str, table: Any) -> int:
    """Rows of ``table`` (a table class) in the database at ``url``, read over a connection of its own."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return int(connection.execute(select(func.count()).select_from(table)).scalar_one())
    finally:
        engine.dispose()


def error_body(error: str, detail: str, field: str | None = None) -> dict[str, Any]:
    """The whole body the service's one error renderer answers a refusal with, for an item-less error
    (``index`` points into a batch's items)."""
    return {"error": error, "detail": detail, "field": field, "index": None}


def wait_for(client: TestClient, batch_id: str, timeout: float = 180.0) -> dict:  # generous: loads of 10+
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status: dict = client.get(f"/v1/batches/{batch_id}").json()
        if status["status"] in ("done", "failed"):
            return status
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {status['status']} after {timeout}s")


def trajectories(n_groups: int = 4, per_group: int = 3, turns: int = 2) -> list[dict]:
    """Text trajectories: group g's prompt is distinct, rewards vary within all but the last group."""
    out = []
    for g in range(n_groups):
        for k in range(per_group):
            out.append(
                {
                    "group_id": g,
                    "reward": 0.0 if g == n_groups - 1 else float(k % 2),
                    "turns": [
                        {
                            "prompt": f"State {g}, turn {t}: the goal lies {['up', 'down', 'left', 'right'][g % 4]}.",
                            "response": f"<think>Goal {g}: option {k} at turn {t}.</think><answer>Up</answer>",
                        }
                        for t in range(turns)
                    ],
                }
            )
    return out


def dependence_matrix(step: int, dependence: float, seed: int = 0, n_columns: int = 4, per_column: int = 3) -> dict:
    """A ``collapse-monitor metrics`` matrix whose input dependence is ``dependence`` nats per token.

    Every row's own prompt scores about -2 nats per token (so H(Z|X) stays flat near 2); the other
    prompts score ``dependence`` lower. At 0 the reasoning no longer depends on the prompt.
    """
    import numpy as np

    rng = np.random.default_rng([seed, step])
    rows = n_columns * per_column
    lengths = rng.integers(8, 16, rows)
    own = np.repeat(np.arange(n_columns), per_column)
    per_token = (
        -2.0 - dependence * (np.arange(n_columns)[None, :] != own[:, None]) + rng.normal(0, 0.05, (rows, n_columns))
    )
    return {
        "step": step,
        "batch_id": f"m-{step}",
        "row_group_ids": own.tolist(),
        "reasoning_lengths": lengths.tolist(),
        "L_seq": (per_token * lengths[:, None]).tolist(),
    }


def long_batch(reasoning_tokens: int, prompt_tokens: int = 20, step: int = 1) -> dict:
    """4 prompts x 2 rollouts of token ids; the rollouts' reasoning differs by prompt."""
    return {
        "step": step,
        "trajectories": [
            {
                "group_id": g,
                "reward": float(k),
                "turns": [
                    {
                        "prompt_token_ids": [10 + g] * prompt_tokens,
                        "reasoning_token_ids": [(20 + 7 * g + k + t) % 200 for t in range(reasoning_tokens)],
                    }
                ],
            }
            for g in range(4)
            for k in range(2)
        ],
    }


def model_figures(rng: random.Random, regime: int) -> dict[str, float]:
    """One step's figures of a model sampler: regime 1 loses the input dependence, 2 the entropy; else healthy."""
    low, flat = regime == 1, regime == 2
    return {
        "mi_estimate": (0.05 if low else 0.6) + rng.gauss(0, 0.05),
        "mi_estimate_se": abs(rng.gauss(0.05, 0.02)),
        "mi_estimate_ci_high": (0.1 if low else 0.7) + rng.gauss(0, 0.1),
        "conditional_entropy_est": 2.0 * (0.3 if flat else 1.0) + rng.gauss(0, 0.2),
        "token_entropy_mean": 1.0 * (0.3 if flat else 1.0) + rng.gauss(0, 0.1),
        "retrieval_above_chance": (0.0 if low else 0.5) + rng.gauss(0, 0.05),
        "mi_zscore_ema": (0.5 if low else 4.0) + rng.gauss(0, 0.3),
    }


def run_figures(rng: random.Random, regime: int) -> dict[str, float]:
    """One step's run-wide figures (sampler ``all``): regime 3 flattens the rewards, 4 drops the reasoning."""
    return {
        "rollout/in_group_reward_std": 0.01 if regime == 3 else rng.uniform(0.3, 1.0),
        "zero_variance_group_ratio": rng.choice([0.0, 0.2, 0.8] if regime == 3 else [0.0, 0.2]),
        "rollout/filter_kept_ratio": rng.random(),
        "valid_thinking_rate": 0.0 if regime == 4 else rng.choice([0.0, 0.5, 1.0]),
        "truncated_think_ratio": rng.choice([0.0, 0.3]),
    }


def points_of(session: Session, batch_id: str) -> tuple[int, int]:
    """(points, distinct (sampler, name) pairs) a batch stored: equal when each figure was stored once."""
    points = session.scalar(select(func.count()).select_from(MetricPoint).where(MetricPoint.batch_id == batch_id))
    distinct = session.scalar(
        select(func.count()).select_from(
            select(MetricPoint.sampler, MetricPoint.name).where(MetricPoint.batch_id == batch_id).distinct().subquery()
        )
    )
    return int(points or 0), int(distinct or 0)
