"""A finished step in storage: what it writes (``ScoredBatch``), finishing a batch with it; the EMA states it
starts from.

The one way a batch is finished (``finish_done``, ``finish_failed``), whoever finishes it: the
worker for a scheduled rollouts batch, ingest for a matrix (scored in the request) and for a
rollouts step off the schedule (its figures computed in the request, ``batch_figures``). Each
writes, in the caller's transaction, the batch's status and results, metric points, the latest
values, EMA states, the cross-scoring matrices (for the web page's heatmap), and the alert state
the new figures lead to.

Alerts are evaluated in step order: the rules' checkpoint resumes from the last evaluated step, so
a step recorded while an earlier step of its run still waits for the worker (an off-schedule step
behind a scheduled one) leaves its points to that earlier step's finish, which evaluates through
them. Must not import fastapi or torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from scoring.estimators import Diagnostics, EmaState
from scoring.window import WindowCut
from service.alerts.state import update_alerts
from service.schemas.results import BatchResult, SamplerResult
from service.settings import Settings
from service.snapshot import RunSnapshot
from service.storage import alerts, points, queue
from service.storage.labels import BATCH, TRAINER
from service.storage.matrices import MatrixRecord, save_matrices
from service.storage.points import Point
from service.storage.tables import Batch, MetricPoint, Run


@dataclass
class ScoredBatch:
    """Everything one scored batch writes, in one transaction."""

    result: BatchResult
    points: list[Point] = field(default_factory=list)
    ema: dict[str, EmaState] = field(default_factory=dict)
    matrices: list[MatrixRecord] = field(default_factory=list)
    tokens: int = 0
    scorer: str | None = None
    checkpoint: str | None = None

    def skip_sampler(self, sampler: str, reason: str) -> None:
        self.result.samplers = self.result.samplers or {}
        self.result.samplers[sampler] = SamplerResult(skipped_reason=reason)

    def add_sampler(
        self,
        sampler: str,
        diagnostics: Diagnostics,
        ema: EmaState,
        matrix: MatrixRecord,
        figures: dict[str, float],
        cut: WindowCut | None = None,
    ) -> None:
        """One sampler's diagnostics: its result, its points, and its EMA and matrix when it scored anything.

        ``figures``: what is computed beside RAGEN's metrics (token entropies, ``scoring.dependence``'s signals).
        ``cut`` is what the window cut from the rows the service scored (None for an uploaded matrix)."""
        rows, columns = matrix.L_tok.shape
        self.result.samplers = self.result.samplers or {}
        self.result.samplers[sampler] = SamplerResult.of(diagnostics, rows, columns, figures, cut)
        self.points.extend(sampler_points(sampler, diagnostics, figures, rows, columns, cut))
        if diagnostics.metrics:
            self.ema[sampler] = ema
            self.matrices.append(matrix)


def sampler_points(
    sampler: str,
    diagnostics: Diagnostics,
    figures: dict[str, float],
    rows: int,
    columns: int,
    cut: WindowCut | None = None,
) -> list[Point]:
    """The stored series of one sampler's diagnostics: metrics, the figures beside them (entropies,
    dependence signals), interval bounds, standard errors, shape, and what the window cut."""
    values = dict(diagnostics.metrics)
    values.update(figures)
    for name, (low, high) in diagnostics.intervals.items():
        values[f"{name}_ci_low"], values[f"{name}_ci_high"] = low, high
    for name, error in diagnostics.standard_errors.items():
        values[f"{name}_se"] = error
    values["rows"], values["columns"] = float(rows), float(columns)
    if cut is not None:
        values["truncated_reasoning_ratio"] = cut.truncated_reasoning_ratio
        values["truncated_prompt_tokens"] = float(cut.prompt_tokens_cut)
    return [Point(sampler, name, float(value)) for name, value in values.items()]


def load_emas(session: Session, run_id: int, samplers: Iterable[str]) -> dict[str, EmaState]:
    """The EMA state each sampler's next scored step starts from (absent before its first)."""
    emas = {}
    for sampler in samplers:
        record = points.ema_state(session, run_id, sampler)
        if record is not None:
            emas[sampler] = EmaState(record.marginal_std, record.marginal_std_seq)
    return emas


def finish_done(
    session: Session,
    run: RunSnapshot,
    batch_id: str,
    owner: str | None,
    scored: ScoredBatch,
    seconds: float,
    settings: Settings,
) -> bool:
    """Marks a batch done with its results and writes what it scored (``record_step``), only while ``owner``
    holds it (None: a batch no worker holds, such as the row ingest has just added in this transaction).

    False when another worker holds the batch now: the caller must roll back."""
    finished = queue.finish_batch(
        session,
        batch_id,
        owner,
        status="done",
        result=scored.result.model_dump(mode="json"),
        scoring_seconds=seconds,
        tokens_scored=scored.tokens,
        scorer=scored.scorer,
        checkpoint=scored.checkpoint,
    )
    if finished:
        record_step(session, run, session.get_one(Batch, batch_id), scored, settings)
    return finished


def finish_failed(session: Session, batch_id: str, owner: str | None, reason: str, settings: Settings) -> bool:
    """Marks a batch failed with ``reason``, only while ``owner`` holds it; False when another worker does.

    Later steps of its run recorded meanwhile (off the schedule) left their alerts to this batch's
    finish: they are evaluated now."""
    if not queue.finish_batch(session, batch_id, owner, status="failed", error=reason):
        return False
    batch = session.get_one(Batch, batch_id)
    run = RunSnapshot.of(session.get_one(Run, batch.run_id))
    if not run.alerts.enabled:
        return True
    _lock_checkpoints(session, run, _in_step_order(run, [*run.samplers, BATCH]))
    later = session.scalars(
        select(MetricPoint.sampler)
        .where(
            MetricPoint.run_id == run.id,
            MetricPoint.segment == batch.segment,
            MetricPoint.step > batch.step,
            MetricPoint.sampler != TRAINER,  # the trainer's own figures: no alert rule reads them
        )
        .distinct()
    ).all()
    waiting = _first_waiting_step(session, batch)
    if later and (waiting is None or waiting > batch.step):
        update_alerts(session, run, batch.step, sorted(later), settings, segment=batch.segment, before=waiting)
    return True


def record_step(session: Session, run: RunSnapshot, batch: Batch, scored: ScoredBatch, settings: Settings) -> None:
    """Writes a scored batch's points, EMA states and matrices, then re-evaluates the alerts they touch
    (left to an earlier step of the run that still waits, which evaluates through them when it finishes)."""
    points.record_points(
        session, run.id, batch.id, batch.step, batch.segment, scored.points, scored.scorer, scored.checkpoint
    )
    step = batch.step
    for sampler, ema in scored.ema.items():
        points.save_ema(session, run.id, sampler, step, ema)
    save_matrices(session, run.id, batch.id, step, scored.matrices)
    samplers = [*(scored.result.samplers or {}), *([BATCH] if scored.result.figures is not None else [])]
    if not run.alerts.enabled:
        return
    lost = {name: result.lost_group_ids for name, result in (scored.result.samplers or {}).items() if result.metrics}
    ordered = _in_step_order(run, samplers)
    if others := [sampler for sampler in samplers if sampler not in ordered]:  # a matrix's own sampler
        update_alerts(session, run, step, others, settings, lost, batch.segment)
    if not ordered:
        return
    _lock_checkpoints(session, run, ordered)
    waiting = _first_waiting_step(session, batch)
    if waiting is None or waiting > step:
        update_alerts(session, run, step, ordered, settings, lost, batch.segment, before=waiting)


def _in_step_order(run: RunSnapshot, samplers: Iterable[str]) -> list[str]:
    """The samplers a waiting batch may still write (a rollouts batch: ``all`` and the run's samplers), whose
    alerts must therefore see the steps in order; a matrix under a sampler name of its own has none."""
    return [sampler for sampler in samplers if sampler == BATCH or sampler in run.samplers]


def _lock_checkpoints(session: Session, run: RunSnapshot, samplers: Iterable[str]) -> None:
    """Locks the (run, sampler)s' alert checkpoints (Postgres; on SQLite the one writer orders finishes
    already) before ``_first_waiting_step`` looks, as the evaluation of an earlier step's finish does: so
    either that finish came first and is seen done, or it waits here and then reads this step's points.
    Sorted, whoever locks them, so that two finishes never wait on each other."""
    if session.get_bind().dialect.name != "postgresql":
        return
    for sampler in sorted(set(samplers)):
        alerts.lock_alert_checkpoint(session, run.id, sampler)


def _first_waiting_step(session: Session, batch: Batch) -> int | None:
    """The first step of the batch's run, in its segment, still queued or being scored (read under
    ``_lock_checkpoints``): the rules read only the steps before it, and none of a batch after it."""
    waiting = select(func.min(Batch.step)).where(
        Batch.run_id == batch.run_id,
        Batch.status.in_(("queued", "scoring")),
        Batch.segment == batch.segment,
        Batch.id != batch.id,
    )
    step = session.scalar(waiting)
    return int(step) if step is not None else None
