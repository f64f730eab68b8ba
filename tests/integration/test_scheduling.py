"""The worker's scheduling and failures: round-robin across runs, the time limit, deterministic
failures failing at once, a restarted worker taking back its batch, a shutdown putting it back."""

from __future__ import annotations

import sqlite3
import threading

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select
from sqlalchemy.exc import OperationalError

from scoring import Scorer
from service.access import issue_token
from service.app import create_app
from service.jobs.scorers import ScorerPool
from service.jobs.worker import Worker
from service.storage import queue
from service.storage.database import make_engine, make_sessions
from service.storage.tables import Batch, MetricPoint, Run
from tests.fixtures import error_body, trajectories

pytestmark = pytest.mark.integration

LIGHT_SAMPLER = {"num_samples": 4, "samplers": ["first_turn"]}


def post(client, run, step, **shape):
    body = {"step": step, "trajectories": trajectories(**shape)}
    response = client.post(f"/v1/runs/{run}/batches", json=body)
    assert response.status_code == 202, response.json()
    return response.json()["batch_id"]


@pytest.fixture
def paused(settings_for):
    """The API with scoring paused (batches wait in the queue), and the sessions of its database."""
    opened = []

    def start(database_url, **overrides):
        settings = settings_for(database_url, **overrides)
        client = TestClient(create_app(settings.model_copy(update={"scoring_paused": True})))
        client.__enter__()
        engine = make_engine(database_url)
        opened.append((client, engine))
        return client, make_sessions(engine), settings

    yield start
    for client, engine in opened:
        client.__exit__(None, None, None)
        engine.dispose()


def test_claims_take_turns_across_runs_so_a_heavy_queue_cannot_starve_a_light_run(database_url, paused):
    client, sessions, _ = paused(database_url)
    for run in ("heavy", "light"):
        assert client.post("/v1/runs", json={"name": run, "sampler": LIGHT_SAMPLER}).status_code == 201
    heavy = [post(client, "heavy", step, turns=1) for step in range(40)]
    light = [post(client, "light", step, turns=1) for step in range(3)]  # all after the heavy run's 40
    order = []
    for _ in range(10):
        with sessions.begin() as session:
            batch = queue.claim_batch(session, "w#1", 60, max_attempts=3)
            assert batch is not None
            order.append(batch.id)
            assert queue.finish_batch(session, batch.id, "w#1", status="done")
    assert order[:6] == [heavy[0], light[0], heavy[1], light[1], heavy[2], light[2]]
    assert order[6:] == heavy[3:7]  # alone again, the heavy run goes on in step order


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def small(client, run, step, token):
    body = {"step": step, "trajectories": trajectories(n_groups=2, per_group=2, turns=1)}
    return client.post(f"/v1/runs/{run}/batches", json=body, headers=bearer(token))


def issue(client, scope="ingest"):
    with client.app.state.monitor.sessions.begin() as session:
        return issue_token(session, scope).secret


def claim_and_finish(sessions) -> Batch:
    with sessions.begin() as session:
        batch = queue.claim_batch(session, "w#1", 60, max_attempts=3)
        assert batch is not None
        assert queue.finish_batch(session, batch.id, "w#1", status="done")
        return batch


def test_claims_take_turns_across_tokens_so_one_token_with_many_runs_cannot_starve_another(database_url, paused):
    client, sessions, _ = paused(database_url, token_cache_seconds=0)
    heavy, light = issue(client), issue(client)
    for r in range(10):
        created = client.post("/v1/runs", json={"name": f"heavy-{r}", "sampler": LIGHT_SAMPLER}, headers=bearer(heavy))
        assert created.status_code == 201
        for step in range(20):
            assert small(client, f"heavy-{r}", step, heavy).status_code == 202
    client.post(
        "/v1/runs", json={"name": "light", "sampler": LIGHT_SAMPLER}, headers={"Authorization": f"Bearer {light}"}
    )
    waiting = small(client, "light", 0, light).json()["batch_id"]  # after the heavy token's 200
    with sessions() as session:
        run_of = dict(session.execute(select(Run.id, Run.name)).all())
    order = [claim_and_finish(sessions) for _ in range(6)]
    assert waiting in [b.id for b in order[:3]]  # not behind the heavy token's 10 runs
    heavy_runs = [run_of[b.run_id] for b in order if b.id != waiting]
    assert heavy_runs == [f"heavy-{r}" for r in range(5)]  # and among its own runs, round-robin


def test_a_token_is_refused_at_its_share_of_the_queue_and_others_are_not(database_url, paused):
    client, sessions, _ = paused(database_url, token_cache_seconds=0, max_queued_per_token=5)
    greedy, other = issue(client), issue(client)
    for name, token in (("g-1", greedy), ("g-2", greedy), ("o-1", other)):
        client.post(
            "/v1/runs", json={"name": name, "sampler": LIGHT_SAMPLER}, headers={"Authorization": f"Bearer {token}"}
        )
    for step in range(5):
        assert small(client, ("g-1", "g-2")[step % 2], step, greedy).status_code == 202
    refused = small(client, "g-2", 5, greedy)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "5"
    assert refused.json() == error_body(
        "token_queue_full",
        "the runs of the token that created this run have 5 batches waiting to be scored, its share "
        "(max_queued_per_token); retry later",
    )
    assert small(client, "o-1", 0, other).status_code == 202  # another token's runs are not held back
    metrics = client.get("/metrics").text
    assert 'collapse_monitor_rejections_total{reason="token_queue_full"} 1.0' in metrics
    claim_and_finish(sessions)  # a batch of the greedy token's is scored: room for one more
    assert small(client, "g-2", 5, greedy).status_code == 202


def test_the_worker_scores_a_light_run_within_its_first_claims(database_url, paused):
    client, sessions, settings = paused(database_url)
    for run in ("heavy", "light"):
        client.post("/v1/runs", json={"name": run, "sampler": LIGHT_SAMPLER})
    for step in range(8):
        post(client, "heavy", step, turns=1)
    light = post(client, "light", 0, turns=1)
    worker = Worker(sessions, settings, ScorerPool(settings))
    claims = 0
    while client.get(f"/v1/batches/{light}").json()["status"] != "done":
        assert worker.run_once()
        claims += 1
        assert claims <= 2, "the light run's batch waited behind the heavy run's"
    worker.close()


def test_a_batch_past_the_time_limit_fails_naming_the_limit_and_the_worker_goes_on(database_url, paused):
    client, sessions, settings = paused(database_url, max_scoring_seconds=0.001)
    client.post("/v1/runs", json={"name": "r", "schedule": {"every": 2}, "sampler": LIGHT_SAMPLER})
    slow, unscheduled = post(client, "r", 1), post(client, "r", 3)  # step 3 is off the schedule: done at ingest
    worker = Worker(sessions, settings, ScorerPool(settings))
    assert worker.run_once()
    assert not worker.run_once()  # nothing left to claim: the failure held nothing back
    worker.close()
    failed, done = (client.get(f"/v1/batches/{b}").json() for b in (slow, unscheduled))
    assert (failed["status"], failed["attempts"]) == ("failed", 1)
    assert failed["error"].startswith("scoring was stopped after ")
    assert "longer than max_scoring_seconds=0.001; send smaller batches" in failed["error"]
    assert done["status"] == "done"


def test_results_the_database_refuses_fail_the_batch_at_once_with_the_reason(database_url, paused):
    client, sessions, settings = paused(database_url)
    client.post("/v1/runs", json={"name": "r", "sampler": LIGHT_SAMPLER})
    refused, later = post(client, "r", 1), post(client, "r", 2)
    # A point already stored under the batch's key (as a hand-edited database may hold): its results collide.
    with sessions.begin() as session:
        run_id = session.scalar(select(Run.id).where(Run.name == "r"))
        planted = MetricPoint(
            run_id=run_id, batch_id=refused, step=1, sampler="first_turn", name="mi_estimate", value=0.0
        )
        session.add(planted)
    worker = Worker(sessions, settings, ScorerPool(settings))
    assert worker.run_once()
    status = client.get(f"/v1/batches/{refused}").json()
    assert (status["status"], status["attempts"]) == ("failed", 1)  # not left leased, to be retried 3 times
    assert status["error"].startswith("scored, but the results could not be stored: IntegrityError")
    with sessions.begin() as session:
        assert session.scalar(select(func.count()).select_from(MetricPoint)) == 1  # the planted one alone
    assert worker.run_once()
    worker.close()
    assert client.get(f"/v1/batches/{later}").json()["status"] == "done"


def test_a_worker_restarted_under_its_name_takes_its_batch_back_at_once(database_url, paused):
    client, sessions, settings = paused(database_url, lease_seconds=300)
    client.post("/v1/runs", json={"name": "r", "sampler": LIGHT_SAMPLER})
    batch_id = post(client, "r", 1)
    crashed = Worker(sessions, settings, ScorerPool(settings))
    alive = Worker(sessions, settings, ScorerPool(settings))  # another worker of this host, busy elsewhere
    assert crashed.name != alive.name
    with sessions.begin() as session:  # the crashed worker had claimed the batch
        assert queue.claim_batch(session, crashed.owner, 300, max_attempts=3) is not None
    assert alive.run_once() is False  # not its predecessor's: it waits out the lease
    crashed.close()  # the process died: its name is free
    restarted = Worker(sessions, settings, ScorerPool(settings))
    assert restarted.name == crashed.name
    assert restarted.owner != crashed.owner
    assert restarted.run_once() is True  # without waiting out the 300 s lease
    restarted.close()
    alive.close()
    status = client.get(f"/v1/batches/{batch_id}").json()
    assert (status["status"], status["attempts"]) == ("done", 2)  # the crash counted as an attempt
    # The crashed process's late completion is refused: leases are held under a per-process owner.
    with sessions.begin() as session:
        assert queue.finish_batch(session, batch_id, crashed.owner, status="done") is False


def test_a_shutdown_abandons_the_batch_at_the_next_layer_and_puts_it_back_uncounted(database_url, paused):
    client, sessions, settings = paused(database_url, lease_seconds=300)
    client.post("/v1/runs", json={"name": "r", "sampler": LIGHT_SAMPLER})
    batch_id = post(client, "r", 1)
    worker = Worker(sessions, settings, ScorerPool(settings))
    layers_seen = threading.Event()

    def stop_when_scoring(*_) -> None:  # SIGTERM arriving mid-forward
        layers_seen.set()
        worker.stop.set()

    # The worker's pool loads the scorer the batch asks for; stop at its first attention layer.
    scorer = worker.pool.get("tiny-random")
    assert isinstance(scorer, Scorer)  # the kernel's, whose layers can be hooked
    hook = scorer.model.base_model.layers[0].self_attn.q_proj.register_forward_pre_hook(stop_when_scoring)
    try:
        assert worker.run_once() is True
    finally:
        hook.remove()
        worker.close()
    assert layers_seen.is_set()
    with sessions() as session:
        batch = session.get_one(Batch, batch_id)
        assert (batch.status, batch.attempts, batch.lease_owner) == ("queued", 0, None)
    other = Worker(sessions, settings, ScorerPool(settings))
    assert other.run_once() is True
    other.close()
    status = client.get(f"/v1/batches/{batch_id}").json()
    assert (status["status"], status["attempts"]) == ("done", 1)


def test_a_checkpoint_that_does_not_load_fails_its_batch_at_once(database_url, paused, tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step-5").mkdir(parents=True)
    (root / "step-5" / "config.json").write_text('{"model_type": "llama"}')  # no weights, no tokenizer
    client, sessions, settings = paused(database_url, checkpoint_root=root)
    client.post("/v1/runs", json={"name": "p", "scorer_mode": "policy", "sampler": LIGHT_SAMPLER})
    announced = client.post("/v1/runs/p/checkpoints", json={"path": "step-5", "kind": "full", "step": 5})
    assert announced.status_code == 201
    broken, later = post(client, "p", 6), post(client, "p", 7)
    worker = Worker(sessions, settings, ScorerPool(settings))
    assert worker.run_once()
    status = client.get(f"/v1/batches/{broken}").json()
    assert (status["status"], status["attempts"]) == ("failed", 1)
    folder = str((root / "step-5").resolve())
    assert status["error"].startswith(f"the full checkpoint {folder!r} of scorer 'tiny-random' could not be loaded: ")
    assert worker.run_once()  # the run's next step is not held behind it (it fails the same way here)
    worker.close()
    assert client.get(f"/v1/batches/{later}").json()["status"] == "failed"


def test_a_database_error_never_fails_a_batch_the_next_round_puts_it_back_uncounted(tmp_path, paused):
    url = f"sqlite:///{tmp_path / 'locked.db'}"
    # A locked database is an outage: the finishing write is retried for as long as the lease lasts,
    # so a short lease keeps this test short.
    client, _, settings = paused(url, lease_seconds=4)
    client.post("/v1/runs", json={"name": "r", "sampler": LIGHT_SAMPLER})
    batch_id = post(client, "r", 1)
    # The worker's own engine gives up on a locked database after 0.2 s (the app's waits 30 s).
    engine = create_engine(url, connect_args={"timeout": 0.2})
    sessions = make_sessions(engine)
    worker = Worker(sessions, settings, ScorerPool(settings))
    other = sqlite3.connect(tmp_path / "locked.db", isolation_level=None)

    def lock_the_database(*_) -> None:  # another writer holds the database while the batch is scored
        if not other.in_transaction:
            other.execute("BEGIN EXCLUSIVE")

    scorer = worker.pool.get("tiny-random")
    assert isinstance(scorer, Scorer)  # the kernel's, whose layers can be hooked
    hook = scorer.model.base_model.layers[0].self_attn.q_proj.register_forward_pre_hook(lock_the_database)
    try:
        with pytest.raises(OperationalError, match="database is locked"):
            worker.run_once()  # the results could not be written: not the batch's fault
    finally:
        hook.remove()
    assert client.get(f"/v1/batches/{batch_id}").json()["status"] == "scoring"  # still leased, not failed
    other.execute("ROLLBACK")
    other.close()
    assert worker.run_once() is True  # puts it back (uncounted), claims it again, scores it
    worker.close()
    engine.dispose()
    status = client.get(f"/v1/batches/{batch_id}").json()
    assert (status["status"], status["attempts"]) == ("done", 1)
