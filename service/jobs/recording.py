"""A scored step in storage: what it writes (``ScoredBatch``) and writing it; the EMA states it starts from.

Rollout batches (scored by a worker) and matrix batches (scored at ingest) write the same things
in the caller's transaction: metric points, the latest values, EMA states, the cross-scoring
matrices (for the web page's heatmap), and the alert state
the new figures lead to. Must not import fastapi or torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from scoring.estimators import Diagnostics, EmaState
from scoring.window import WindowCut
from service.alerts.state import update_alerts
from service.schemas import BatchResult, SamplerResult
from service.settings import Settings
from service.snapshot import RunSnapshot
from service.storage import queries
from service.storage.matrices import MatrixRecord, save_matrices
from service.storage.queries import Point
from service.storage.tables import Batch

ALL = "all"  # the sampler label of batch-level figures (rewards, coverage)


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
        entropy: dict[str, float],
        cut: WindowCut | None = None,
    ) -> None:
        """One sampler's diagnostics: its result, its points, and its EMA and matrix when it scored anything.

        ``cut`` is what the window cut from the rows the service scored (None for an uploaded matrix)."""
        rows, columns = matrix.L_tok.shape
        self.result.samplers = self.result.samplers or {}
        self.result.samplers[sampler] = SamplerResult.of(diagnostics, rows, columns, entropy, cut)
        self.points.extend(sampler_points(sampler, diagnostics, entropy, rows, columns, cut))
        if diagnostics.metrics:
            self.ema[sampler] = ema
            self.matrices.append(matrix)


def sampler_points(
    sampler: str,
    diagnostics: Diagnostics,
    entropy: dict[str, float],
    rows: int,
    columns: int,
    cut: WindowCut | None = None,
) -> list[Point]:
    """The stored series of one sampler's diagnostics: metrics, entropies, interval bounds, standard
    errors, shape, and what the window cut."""
    values = dict(diagnostics.metrics)
    values.update(entropy)
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
        record = queries.ema_state(session, run_id, sampler)
        if record is not None:
            emas[sampler] = EmaState(record.marginal_std, record.marginal_std_seq)
    return emas


def record_step(session: Session, run: RunSnapshot, batch: Batch, scored: ScoredBatch, settings: Settings) -> None:
    """Writes a scored batch's points, EMA states and matrices, then re-evaluates the alerts they touch."""
    queries.record_points(
        session, run.id, batch.id, batch.step, batch.segment, scored.points, scored.scorer, scored.checkpoint
    )
    step = batch.step
    for sampler, ema in scored.ema.items():
        queries.save_ema(session, run.id, sampler, step, ema)
    save_matrices(session, run.id, batch.id, step, scored.matrices)
    samplers = [*(scored.result.samplers or {}), *([ALL] if scored.result.figures is not None else [])]
    lost = {name: result.lost_group_ids for name, result in (scored.result.samplers or {}).items() if result.metrics}
    update_alerts(session, run, step, samplers, settings, lost, batch.segment)
