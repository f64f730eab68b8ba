"""Alert checkpoints: resuming the rules from a (run, sampler)'s checkpoint stores exactly what replaying
its whole history would, and a step's work does not grow with the history."""

from __future__ import annotations

import random
import uuid

import pytest
from sqlalchemy import delete, event, insert, select, update
from sqlalchemy.orm import Session

from service.jobs.recording import ScoredBatch, record_step
from service.schemas.alerts import AlertSettings
from service.schemas.results import BatchResult, SamplerResult
from service.snapshot import RunSnapshot
from service.storage import runs
from service.storage.database import make_engine, make_sessions, migrate
from service.storage.labels import BATCH
from service.storage.points import Point
from service.storage.tables import Alert, AlertCheckpoint, AlertDelivery, Batch, MetricPoint, Run
from tests.fixtures import model_figures, run_figures

pytestmark = pytest.mark.integration

SAMPLER = "first_turn"
CONFIGS = [
    AlertSettings(baseline_steps=4, window=2, resolve_window=2, use_intervals=True, signal="retrieval_above_chance"),
    AlertSettings(baseline_steps=3, window=1, resolve_window=3, signal="mi_cusum", cusum_threshold=2.0),
    AlertSettings(
        baseline_steps=5, window=3, reward_window=4, signal="mi_zscore_ema", entropy_signal="token_entropy_mean"
    ),
]


class Service:
    """One database with one run, written to as a worker writes a scored step (``record_step``)."""

    def __init__(self, url, settings, config, *, whole_replays=False, name="r"):
        migrate(url)
        self.engine = make_engine(url)
        self.sessions = make_sessions(self.engine)
        self.settings = settings
        self.whole_replays = whole_replays  # the oracle: its checkpoints are deleted before every step
        self.delivered = 0
        with self.sessions.begin() as session:
            run = Run(name=name, scorer="tiny-random", scorer_mode="reference", samplers=[SAMPLER])
            run.alert_rules = config.model_dump()
            session.add(run)
            session.flush()
            self.run = RunSnapshot.of(run)

    def write(self, step, points, lost):
        with self.sessions.begin() as session:
            if self.whole_replays:
                session.execute(delete(AlertCheckpoint))
            segment = runs.advance_segment(session, self.run.id, step, matrix_sampler=SAMPLER)
            assert segment is not None
            batch = Batch(
                id=uuid.uuid4().hex,
                run_id=self.run.id,
                step=step,
                segment=segment.number,
                kind="matrix",
                payload="",
                payload_sha256="",
                status="done",
            )
            session.add(batch)
            session.flush()
            samplers = {}
            if any(p.sampler == SAMPLER for p in points):
                samplers[SAMPLER] = SamplerResult(metrics={"mi_estimate": 0.0}, lost_group_ids=lost)
            else:
                samplers[SAMPLER] = SamplerResult(skipped_reason="no reasoning")
            has_all = any(p.sampler == BATCH for p in points)
            scored = ScoredBatch(result=BatchResult(scored=True, samplers=samplers, figures={} if has_all else None))
            scored.points = points
            record_step(session, self.run, batch, scored, self.settings)

    def alerts(self):
        """The stored alerts by (sampler, rule, onset), and the deliveries queued since the last call."""
        with self.sessions() as session:
            alerts = session.scalars(select(Alert).where(Alert.run_id == self.run.id).order_by(Alert.id)).all()
            key = {a.id: (a.sampler, a.rule, a.onset_step) for a in alerts}
            stored = {
                key[a.id]: (
                    a.severity,
                    a.state,
                    a.fired_step,
                    a.resolved_step,
                    a.last_step,
                    a.value,
                    a.baseline,
                    a.threshold,
                    a.summary,
                    a.description,
                )
                for a in alerts
            }
            deliveries = session.scalars(
                select(AlertDelivery).where(AlertDelivery.id > self.delivered).order_by(AlertDelivery.id)
            ).all()
            self.delivered = max((d.id for d in deliveries), default=self.delivered)
            queued = [(key[d.alert_id], d.receiver, d.event, _timeless(d.payload)) for d in deliveries]
        return stored, queued

    def close(self):
        self.engine.dispose()


def _timeless(payload):
    """A delivery's payload without the moments it was made at (Alertmanager's startsAt/endsAt)."""
    if isinstance(payload, dict):
        return {k: _timeless(v) for k, v in payload.items() if k not in ("startsAt", "endsAt")}
    if isinstance(payload, list):
        return [_timeless(v) for v in payload]
    return payload


def random_step(rng, regime):
    """One step's points: input dependence, entropy and rewards move between regimes; series go missing."""
    points = [Point(SAMPLER, n, v) for n, v in model_figures(rng, regime).items() if rng.random() < 0.95]
    if rng.random() < 0.08:
        points = []  # the sampler scored nothing this step
    figures = run_figures(rng, regime)
    if rng.random() < 0.9:
        points += [Point(BATCH, n, v) for n, v in figures.items() if rng.random() < 0.95]
    return points


@pytest.mark.parametrize("config", CONFIGS, ids=["intervals", "cusum", "token-entropy"])
def test_resuming_from_checkpoints_stores_what_whole_replays_do(tmp_path, settings_for, config):
    check_against_whole_replays(f"sqlite:///{tmp_path / 'monitor.db'}", settings_for, tmp_path, config)


def test_resuming_from_checkpoints_on_postgres_stores_what_whole_replays_do(postgres_url, settings_for, tmp_path):
    # One configuration: what differs on Postgres is the checkpoint's lock and upsert, not the rules.
    check_against_whole_replays(postgres_url, settings_for, tmp_path, CONFIGS[0])


def check_against_whole_replays(database_url, settings_for, tmp_path, config, n_steps=120):
    """Writes the same random history (regime changes, resumes, a step sent twice, missing series) to a
    database whose alerts resume from checkpoints and to one whose checkpoints are deleted before every
    step; after every step both hold the same alerts and have queued the same notifications."""
    settings = settings_for(
        database_url, alert_webhooks=["http://127.0.0.1:9/hook"], alertmanager_url="http://127.0.0.1:9"
    )
    resumed = Service(database_url, settings, config)
    whole = Service(f"sqlite:///{tmp_path / 'oracle.db'}", settings, config, whole_replays=True)
    rng = random.Random(str(config))
    step, regime, fired = 0, 0, 0
    try:
        for _ in range(n_steps):
            if rng.random() < 0.12:
                regime = rng.randrange(5)
            roll = rng.random()
            if roll < 0.02 and step > 20:
                step -= rng.randrange(5, 20)  # the trainer resumed from an earlier checkpoint: a new segment
            elif roll < 0.05:
                pass  # the same step sent twice
            else:
                step += rng.choice([1, 1, 1, 2])
            points = random_step(rng, regime)
            lost = rng.choice([[], [1, 3]])
            resumed.write(step, points, lost)
            whole.write(step, points, lost)
            stored = resumed.alerts()
            assert stored == whole.alerts(), f"after step {step}"
            fired = sum(1 for alert in stored[0].values() if alert[2] is not None)
        assert fired >= 3  # the history fired (and resolved) alerts of several rules
    finally:
        resumed.close()
        whole.close()


def seed_history(service, n_steps):
    """``n_steps`` scored steps of the rules' series written in bulk (as years of a run would leave them)."""
    names = [
        "mi_estimate",
        "mi_estimate_se",
        "mi_estimate_ci_high",
        "conditional_entropy_est",
        "retrieval_above_chance",
    ]
    rng = random.Random(n_steps)
    with service.sessions.begin() as session:
        batches = [
            {
                "id": uuid.uuid4().hex,
                "run_id": service.run.id,
                "step": k,
                "segment": 0,
                "kind": "matrix",
                "payload": "",
                "payload_sha256": "",
                "status": "done",
            }
            for k in range(1, n_steps + 1)
        ]
        session.execute(insert(Batch), batches)
        session.execute(
            insert(MetricPoint),
            [
                {
                    "run_id": service.run.id,
                    "batch_id": b["id"],
                    "step": b["step"],
                    "segment": 0,
                    "sampler": SAMPLER,
                    "name": name,
                    "value": 0.5 + rng.gauss(0, 0.05),
                }
                for b in batches
                for name in names
            ],
        )
        session.execute(update(Run).where(Run.id == service.run.id).values(claimed_step=n_steps))


def metric_point_rows_read(service, step):
    """Rows of metric_points the database hands back while one scored step is written and its alerts evaluated."""
    read = []

    def count(state):
        if state.is_select and "metric_points" in str(state.statement):
            frozen = state.invoke_statement().freeze()
            read.append(len(frozen().all()))
            return frozen()
        return None

    event.listen(Session, "do_orm_execute", count)
    try:
        service.write(step, random_step(random.Random(0), 0), [])
    finally:
        event.remove(Session, "do_orm_execute", count)
    return sum(read)


def test_a_steps_alert_evaluation_reads_the_same_rows_after_1k_or_10k_steps(database_url, settings_for):
    settings, config = settings_for(database_url), AlertSettings(baseline_steps=5)
    read = {}
    for n_steps in (1000, 10_000):
        service = Service(database_url, settings, config, name=f"r{n_steps}")
        try:
            seed_history(service, n_steps)
            whole = metric_point_rows_read(service, n_steps + 1)
            read[n_steps] = [metric_point_rows_read(service, step) for step in range(n_steps + 2, n_steps + 5)]
        finally:
            service.close()
        assert whole >= 3 * n_steps  # the first evaluation replays the history once and writes a checkpoint
    # Then each step reads its own points only; a whole replay reads 30,000 rows per step at 10k steps.
    assert read[1000] == read[10_000]
    assert max(read[10_000]) <= 20
