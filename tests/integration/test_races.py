"""Races between writers of one row, played out for real on SQLite and Postgres: two sessions, two threads.

Each test stops one writer between its read and its write (a hook on its engine, just before the
statement), lets the other commit, then lets the first go on: the interleaving a busy machine
produces now and then, made to happen every time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, func, select, update

from scoring import Scorer
from service.app import create_app
from service.ingest.runs import delete_run
from service.jobs.scorers import ScorerPool
from service.jobs.worker import Worker
from service.storage import alerts, clock, queue
from service.storage.database import make_engine, make_sessions
from service.storage.tables import Alert, AlertDelivery, Batch, MetricPoint, Run, as_utc
from tests.fixtures import dependence_matrix, trajectories

pytestmark = pytest.mark.integration

LIGHT_SAMPLER = {"num_samples": 4, "samplers": ["first_turn"]}
WAIT_SECONDS = 60.0  # generous: only a broken interleaving waits this long


@contextmanager
def paused_before(engine: Engine, prefix: str, pause: Callable[[], None]) -> Iterator[None]:
    """Calls ``pause()`` once, just before ``engine`` sends the first statement that starts with ``prefix``."""
    done = threading.Event()

    def before(_conn, _cursor, statement: str, *_args) -> None:
        if not done.is_set() and statement.lstrip().upper().startswith(prefix):
            done.set()
            pause()

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield
    finally:
        event.remove(engine, "before_cursor_execute", before)


@pytest.fixture
def queued(database_url, settings_for):
    """One queued batch of run ``r`` (scoring paused in the API), and a fresh engine per caller."""
    settings = settings_for(database_url, lease_seconds=300)
    engines: list[Engine] = []

    def engine() -> Engine:
        engines.append(make_engine(database_url))
        return engines[-1]

    with TestClient(create_app(settings.model_copy(update={"scoring_paused": True}))) as client:
        client.post("/v1/runs", json={"name": "r", "sampler": LIGHT_SAMPLER})
        response = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": trajectories()})
        assert response.status_code == 202
    yield settings, response.json()["batch_id"], engine
    for e in engines:
        e.dispose()


def expire_lease(engine: Engine, batch_id: str) -> None:
    """The slow worker's lease runs out (its heartbeat stalled): an hour ago by the database's clock."""
    with make_sessions(engine).begin() as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(lease_expires_at=clock.db_time(-3600)))


def stored(engine: Engine, batch_id: str) -> tuple[Batch, int, int]:
    """The batch, its metric points, and its distinct (sampler, name) pairs (equal when written once)."""
    with make_sessions(engine)() as session:
        batch = session.get_one(Batch, batch_id)
        where = MetricPoint.batch_id == batch_id
        points = session.scalar(select(func.count()).select_from(MetricPoint).where(where))
        pairs = select(MetricPoint.sampler, MetricPoint.name).where(where).distinct().subquery()
        distinct = session.scalar(select(func.count()).select_from(pairs))
        return batch, int(points or 0), int(distinct or 0)


def at_first_layer(worker: Worker, action: Callable[[], None]):
    """Runs ``action`` once, when ``worker`` is in the middle of its first forward; returns the hook's remover."""
    fired = threading.Event()

    def hook(*_) -> None:
        if not fired.is_set():
            fired.set()
            action()

    scorer = worker.pool.get("tiny-random")
    assert isinstance(scorer, Scorer)  # the kernel's, whose layers can be hooked
    # On a submodule: the kernel's own forward (scoring/forward.py) calls a layer's parts, not the layer.
    return scorer.model.base_model.layers[0].self_attn.q_proj.register_forward_pre_hook(hook).remove


def test_a_claim_of_an_expired_lease_never_overwrites_the_slow_workers_done(queued):
    """The claim reads the batch (scoring, lease expired), the slow worker commits done, the claim writes."""
    settings, batch_id, engine = queued
    slow_engine, claim_engine = engine(), engine()
    slow = Worker(make_sessions(slow_engine), settings, ScorerPool(settings))
    claim_has_read, slow_has_finished = threading.Event(), threading.Event()
    claimed: list[Batch | None] = []

    def claim() -> None:
        with make_sessions(claim_engine).begin() as session:
            claimed.append(queue.claim_batch(session, "claimer#1", 300, max_attempts=3))

    def wait_for_the_slow_worker() -> None:
        claim_has_read.set()
        assert slow_has_finished.wait(WAIT_SECONDS)

    claimer = threading.Thread(target=claim)

    def lease_runs_out_and_a_claim_reads() -> None:
        expire_lease(slow_engine, batch_id)
        claimer.start()
        assert claim_has_read.wait(WAIT_SECONDS)  # the claim saw the batch as claimable

    remove = at_first_layer(slow, lease_runs_out_and_a_claim_reads)
    try:
        with paused_before(claim_engine, "UPDATE BATCHES", wait_for_the_slow_worker):
            assert slow.run_once() is True  # scores and commits done while the claim waits to write
            slow_has_finished.set()
            claimer.join(WAIT_SECONDS)
    finally:
        slow_has_finished.set()
        remove()
        slow.close()
    assert not claimer.is_alive()
    assert claimed == [None]  # the claim's compare-and-set found the batch done: nothing else to claim
    batch, points, distinct = stored(slow_engine, batch_id)
    assert (batch.status, batch.attempts, batch.lease_owner, batch.scorer) == ("done", 1, None, "tiny-random")
    assert batch.result is not None
    assert points == distinct > 0


def test_a_slow_workers_late_finish_never_overwrites_the_claim_that_took_its_batch(queued):
    """The other order: the claim commits first, scores the batch; the slow worker's finish changes nothing."""
    settings, batch_id, engine = queued
    slow_engine, other_engine = engine(), engine()
    slow = Worker(make_sessions(slow_engine), settings, ScorerPool(settings))
    other = Worker(make_sessions(other_engine), settings, ScorerPool(settings))

    def lease_runs_out_and_another_worker_scores_the_batch() -> None:
        expire_lease(slow_engine, batch_id)
        assert other.run_once() is True

    remove = at_first_layer(slow, lease_runs_out_and_another_worker_scores_the_batch)
    try:
        assert slow.run_once() is True
    finally:
        remove()
        slow.close()
        other.close()
    batch, points, distinct = stored(slow_engine, batch_id)
    assert (batch.status, batch.attempts, batch.lease_owner) == ("done", 2, None)
    assert points == distinct > 0  # one batch's points: the slow worker's write was rolled back


def test_a_lease_is_timed_by_the_database_clock_not_the_claiming_hosts(queued, monkeypatch):
    _, batch_id, engine = queued
    sessions = make_sessions(engine())
    # This host's clock runs an hour ahead (the clock is what may be faked: it is external), should the queue
    # ever read it.
    monkeypatch.setattr(queue, "utcnow", lambda: datetime.now(UTC) + timedelta(hours=1), raising=False)
    with sessions.begin() as session:
        claimed = queue.claim_batch(session, "w#1", 300, max_attempts=3)
        assert claimed is not None
        database_now = as_utc(session.scalar(select(clock.db_time())))
    assert database_now is not None
    started, expires = as_utc(claimed.started_at), as_utc(claimed.lease_expires_at)
    assert started is not None
    assert expires is not None
    assert (expires - started).total_seconds() == pytest.approx(300, abs=0.01)
    assert abs((started - database_now).total_seconds()) < 60  # not an hour ahead
    with sessions.begin() as session:  # renewed from the database's now too
        assert queue.renew_lease(session, batch_id, "w#1", 600)
        renewed = as_utc(session.scalar(select(Batch.lease_expires_at).where(Batch.id == batch_id)))
    assert renewed is not None
    assert 590 < (renewed - started).total_seconds() < 1200


def test_a_delivery_recorded_between_a_claims_read_and_write_is_not_taken_back(queued):
    """Two dispatchers: one's lease ran out but it records ``delivered``; the other's claim must not resend it.

    SQLite only: on Postgres the claim's read locks the row (SKIP LOCKED), so the record waits for it.
    """
    settings, _, engine = queued
    if not settings.is_sqlite:
        pytest.skip("on Postgres the claim's SELECT ... FOR UPDATE holds the row: this interleaving cannot happen")
    first_engine, second_engine = engine(), engine()
    with make_sessions(first_engine).begin() as session:
        run_id = session.scalar(select(Run.id).where(Run.name == "r"))
        alert = Alert(run_id=run_id, sampler="s", rule="TemplateCollapse", severity="critical", state="firing")
        alert.onset_step = alert.last_step = 1
        alert.summary = alert.description = "x"
        session.add(alert)
        session.flush()
        session.add(
            AlertDelivery(
                alert_id=alert.id,
                receiver="webhook",
                url="http://127.0.0.1:9/hook",
                event="firing",
                payload={},
                status="pending",
                attempts=0,
                next_attempt_at=clock.db_time(),
            )
        )
    with make_sessions(first_engine).begin() as session:
        (delivery,) = alerts.claim_deliveries(session, "first", 60, 10)
        delivery_id = delivery.id
    with make_sessions(first_engine).begin() as session:  # the first dispatcher's lease runs out mid-send
        session.execute(update(AlertDelivery).values(next_attempt_at=clock.db_time(-3600)))

    def first_records_delivered() -> None:
        with make_sessions(first_engine).begin() as session:
            assert alerts.record_delivery(
                session, delivery_id, "first", status="delivered", error=None, retry_seconds=None
            )

    with (
        paused_before(second_engine, "UPDATE ALERT_DELIVERIES", first_records_delivered),
        make_sessions(second_engine).begin() as session,
    ):
        assert alerts.claim_deliveries(session, "second", 60, 10) == []
    with make_sessions(first_engine)() as session:
        stored_delivery = session.get_one(AlertDelivery, delivery_id)
        assert (stored_delivery.status, stored_delivery.attempts, stored_delivery.lease_owner) == ("delivered", 1, None)


@pytest.mark.parametrize("route", ["batches", "matrices", "checkpoints"])
def test_a_run_deleted_while_a_write_to_it_is_handled_answers_404_never_500(database_url, client_for, tmp_path, route):
    """The write has read the run; the delete commits; the write's first change of the run then finds none."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    client = client_for(database_url, scoring_paused=True, checkpoint_root=tmp_path)
    client.post("/v1/runs", json={"name": "r", "sampler": LIGHT_SAMPLER})
    other = make_engine(database_url)
    bodies = {
        "batches": {"step": 1, "trajectories": trajectories()},
        "matrices": dependence_matrix(1, 2.0),
        "checkpoints": {"path": "ckpt", "step": 1},
    }
    first_write = "INSERT INTO CHECKPOINTS" if route == "checkpoints" else "UPDATE RUNS"
    deleted: list[dict[str, int]] = []
    try:
        with paused_before(
            client.app.state.monitor.engine,
            first_write,
            lambda: deleted.append(delete_run(make_sessions(other), "r")),
        ):
            response = client.post(f"/v1/runs/r/{route}", json=bodies[route])
    finally:
        other.dispose()
    assert deleted[0]["runs"] == 1
    assert response.status_code == 404, response.text
    assert response.json()["error"] == "not_found"
    assert response.json()["field"] == "run"
    assert "was deleted while" in response.json()["detail"]
    assert client.get("/v1/runs/r").status_code == 404


def test_deletes_racing_ingest_from_threads_answer_only_404_or_success(database_url, client_for):
    client = client_for(database_url, scoring_paused=True, rate_limit_per_second=0)
    statuses: list[int] = []
    stop = threading.Event()

    def ingest() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            body = {"step": step, "trajectories": trajectories(n_groups=2, per_group=2, turns=1)}
            statuses.append(client.post("/v1/runs/r/batches", json=body).status_code)

    client.post("/v1/runs", json={"name": "r", "sampler": LIGHT_SAMPLER})
    threads = [threading.Thread(target=ingest) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(15):  # bounded: delete and re-create the run under the writers
            assert client.delete("/v1/runs/r").status_code in (204, 404)
            assert client.post("/v1/runs", json={"name": "r", "sampler": LIGHT_SAMPLER}).status_code in (200, 201)
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_SECONDS)
    assert statuses
    assert set(statuses) <= {202, 404}, sorted(set(statuses))


def test_trainer_processes_posting_one_run_at_once_get_it_created_once_never_500(database_url, client_for):
    client = client_for(database_url, scoring_paused=True, rate_limit_per_second=0)
    statuses: dict[str, list[int]] = {}
    for r in range(10):
        name, at_once = f"ranks-{r}", threading.Barrier(4)

        def post(name: str = name, at_once: threading.Barrier = at_once) -> None:
            at_once.wait(WAIT_SECONDS)
            statuses.setdefault(name, []).append(client.post("/v1/runs", json={"name": name}).status_code)

        threads = [threading.Thread(target=post) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_SECONDS)
    for name, answers in statuses.items():
        assert sorted(answers) == [200, 200, 200, 201], (name, answers)  # 500 for the losers before
