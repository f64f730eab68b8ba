"""A vLLM scorer whose server does not answer, against a real worker, database and HTTP server on loopback: the
batch goes back to the queue with the scorer's error, uncounted; the worker claims none of the scorer's batches
until its probe finds the server answering, then scores the batch; /readyz and /metrics name the scorer while
it is down; past scorer_outage_seconds its batches fail with its last error.

The real server, killed mid-batch and restarted: tests/vllm/test_vllm_scorer.py.
"""

from __future__ import annotations

import socket
import time

import pytest
from sqlalchemy import func, select

from scoring.models import load_tokenizer
from service.jobs.scorers import ScorerPool
from service.jobs.worker import Worker
from service.storage.database import make_engine, make_sessions
from service.storage.tables import Batch, MetricPoint
from tests.fixtures import trajectories
from tests.misbehaving_vllm import misbehaving_server

pytestmark = pytest.mark.integration

# Generous: the breaker's back-offs (2 s, 4 s, ... each up to a quarter longer) and a busy machine.
WITHIN_SECONDS = 60.0


def closed_port() -> int:
    with socket.socket() as s:  # bound, then released: nothing listens there
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_until(worker: Worker, done, seconds: float = WITHIN_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "not within the bound"
        if not worker.run_once():
            time.sleep(0.1)


def status(sessions, batch_id: str) -> str:
    with sessions() as session:
        return str(session.get_one(Batch, batch_id).status)


def scorer_up(client, scorer: str) -> str:
    line = next(
        x
        for x in client.get("/metrics").text.splitlines()
        if x.startswith(f'collapse_monitor_scorer_up{{scorer="{scorer}"}}')
    )
    return str(line.split()[-1])


def test_a_batch_waits_uncounted_while_its_vllm_server_is_down_and_is_scored_once_it_answers(
    database_url, client_for, settings_for
):
    with misbehaving_server("5xx") as server:
        spec = f"vllm+http://127.0.0.1:{server.server_address[1]}?model=m&tokenizer=tiny-random&dtype=float32"
        overrides = {"scorers": {"remote": spec}, "default_scorer": "remote", "vllm_retries": 0, "max_attempts": 1}
        client = client_for(database_url, embedded_worker=False, **overrides)
        client.post("/v1/runs", json={"name": "r", "sampler": {"num_samples": 4}})
        batch = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": trajectories()})
        batch_id = batch.json()["batch_id"]
        settings = settings_for(database_url, **overrides)
        tokenizer = load_tokenizer("tiny-random", settings.cache_dir)
        server.tokenize = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])
        engine = make_engine(database_url)
        sessions = make_sessions(engine)
        worker = Worker(sessions, settings, ScorerPool(settings))
        try:
            assert worker.run_once() is True  # the try: put back, uncounted, with the scorer's error on it
            with sessions() as session:
                waiting = session.get_one(Batch, batch_id)
                assert (waiting.status, waiting.attempts) == ("queued", 0)
                assert "scorer 'remote'" in (waiting.error or "")
                assert "503: engine is restarting" in (waiting.error or "")
            ready = client.get("/readyz")
            assert ready.status_code == 200  # the service still takes batches: one scorer down is not unready
            assert "503: engine is restarting" in ready.json()["scorers_down"]["remote"]["error"]
            assert scorer_up(client, "remote") == "0.0"
            tries = server.tries
            assert worker.run_once() is False  # the breaker is open: its batch is not claimed
            run_until(worker, lambda: server.tries > tries)  # ... but the server is probed
            assert status(sessions, batch_id) == "queued"  # max_attempts=1 did not end it

            server.mode = "ok"
            run_until(worker, lambda: status(sessions, batch_id) == "done")
            with sessions() as session:
                scored = session.get_one(Batch, batch_id)
                assert (scored.attempts, scored.error) == (1, None)
                assert session.scalar(select(func.count()).where(MetricPoint.batch_id == batch_id))
            assert client.get("/readyz").json()["scorers_down"] == {}
            assert scorer_up(client, "remote") == "1.0"
        finally:
            worker.close()
            engine.dispose()


def test_a_batch_whose_vllm_server_stays_down_fails_with_its_last_error_after_scorer_outage_seconds(
    database_url, client_for, settings_for
):
    spec = f"vllm+http://127.0.0.1:{closed_port()}?model=m&tokenizer=tiny-random&dtype=float32"
    overrides = {"scorers": {"remote": spec}, "default_scorer": "remote", "vllm_retries": 0, "scorer_outage_seconds": 3}
    client = client_for(database_url, embedded_worker=False, **overrides)
    client.post("/v1/runs", json={"name": "r", "sampler": {"num_samples": 4}})
    first = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": trajectories()}).json()["batch_id"]
    settings = settings_for(database_url, **overrides)
    engine = make_engine(database_url)
    sessions = make_sessions(engine)
    worker = Worker(sessions, settings, ScorerPool(settings))

    try:
        start = time.monotonic()
        run_until(worker, lambda: status(sessions, first) == "failed")
        assert time.monotonic() - start >= 3  # not before scorer_outage_seconds
        with sessions() as session:
            failed = session.get_one(Batch, first)
            assert (failed.error or "").startswith("scorer 'remote' has not answered for ")
            assert "(scorer_outage_seconds=3); giving up. Its last error: scorer 'remote': the vLLM server" in (
                failed.error or ""
            )
            assert "ConnectError" in (failed.error or "")
            assert not session.scalar(select(func.count()).where(MetricPoint.batch_id == first))
        # While it stays down, a later batch of its runs fails at its claim, without waiting again.
        later = client.post("/v1/runs/r/batches", json={"step": 2, "trajectories": trajectories()}).json()["batch_id"]
        worker.run_once()
        assert status(sessions, later) == "failed"
        assert "remote" in client.get("/readyz").json()["scorers_down"]
    finally:
        worker.close()
        engine.dispose()
