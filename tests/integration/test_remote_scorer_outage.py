"""A vLLM scorer whose server does not answer: the batch waits in the queue, never failed, never counted.

The real server, killed mid-batch and restarted: tests/vllm/test_vllm_scorer.py.
"""

from __future__ import annotations

import socket

import pytest
from sqlalchemy import func, select

from service.jobs.scorers import ScorerPool
from service.jobs.worker import Worker
from service.storage.database import make_engine, make_sessions
from service.storage.tables import Batch, MetricPoint
from tests.fixtures import trajectories

pytestmark = pytest.mark.integration


def closed_port() -> int:
    with socket.socket() as s:  # bound, then released: nothing listens there
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_batch_whose_vllm_server_is_down_waits_with_its_error_then_fails_with_it_past_max_attempts(
    database_url, client_for, settings_for
):
    spec = f"vllm+http://127.0.0.1:{closed_port()}?model=m&tokenizer=tiny-random&dtype=float32"
    overrides = {"scorers": {"remote": spec}, "default_scorer": "remote", "vllm_retries": 0, "max_attempts": 1}
    client = client_for(database_url, embedded_worker=False, **overrides)
    client.post("/v1/runs", json={"name": "r", "sampler": {"num_samples": 4}})
    batch_id = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": trajectories()}).json()["batch_id"]
    settings = settings_for(database_url, **overrides)
    engine = make_engine(database_url)
    sessions = make_sessions(engine)
    worker = Worker(sessions, settings, ScorerPool(settings))
    try:
        assert worker.run_once() is True  # the try: put back, counted, with the scorer's error on it
        with sessions() as session:
            batch = session.get_one(Batch, batch_id)
            assert (batch.status, batch.attempts) == ("queued", 1)
            assert "scorer 'remote'" in (batch.error or "")
        worker._scorers_down.clear()  # the breaker's back-off over: the next claim is past max_attempts
        worker.run_once()  # fails the batch instead of claiming it
        with sessions() as session:
            batch = session.get_one(Batch, batch_id)
            assert batch.status == "failed"
            assert "giving up. The last try: scorer 'remote'" in (batch.error or "")
            assert not session.scalar(select(func.count()).where(MetricPoint.batch_id == batch_id))
    finally:
        worker.close()
        engine.dispose()
