"""Stored cross-scoring matrices: written with a batch's metric points, read back for one step.

Functions of a Session, like the other table families'; callers own the transaction. Must not import fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, defer

from service.storage.tables import Batch, ScoreMatrix


@dataclass(frozen=True)
class MatrixRecord:
    """One sampler's matrix of one batch, as the scorer computed it (rows in scoring order)."""

    sampler: str
    L_tok: np.ndarray  # [R, N] nats per reasoning token
    column_of_row: Sequence[int] | np.ndarray  # [R]
    column_labels: Sequence[int]  # [N] prompt group ids
    row_sources: Sequence[tuple[int, int]] | None = None  # [R] (trajectory, turn); None when sent as a matrix
    excerpts: Sequence[Sequence[str]] | None = None  # [N] reasoning excerpts per column (reasoning_excerpts)


def save_matrices(session: Session, run_id: int, batch_id: str, step: int, records: Sequence[MatrixRecord]) -> None:
    """Stores a batch's matrices (float32: the figures are computed in float64 before, never from these)."""
    for record in records:
        n_rows, n_columns = record.L_tok.shape
        session.add(
            ScoreMatrix(
                batch_id=batch_id,
                sampler=record.sampler,
                run_id=run_id,
                step=step,
                n_rows=n_rows,
                n_columns=n_columns,
                l_tok=np.ascontiguousarray(record.L_tok, dtype="<f4").tobytes(),
                column_of_row=[int(c) for c in record.column_of_row],
                column_labels=[int(c) for c in record.column_labels],
                row_sources=[[int(m), int(k)] for m, k in record.row_sources] if record.row_sources else None,
                excerpts=[list(texts) for texts in record.excerpts] if record.excerpts is not None else None,
            )
        )


def matrix_at(session: Session, run_id: int, sampler: str | None, step: int | None) -> tuple[ScoreMatrix, Batch] | None:
    """The matrix of ``sampler`` (any when None) at ``step`` (the newest when None), with its batch.

    The batch's payload (up to 32 MB) is not read: the heatmap's excerpts are stored with the matrix.
    """
    query = (
        select(ScoreMatrix, Batch)
        .join(Batch, Batch.id == ScoreMatrix.batch_id)
        .options(defer(Batch.payload, raiseload=True))
    )
    query = query.where(ScoreMatrix.run_id == run_id)
    if sampler is not None:
        query = query.where(ScoreMatrix.sampler == sampler)
    if step is not None:
        query = query.where(ScoreMatrix.step == step)
    row = session.execute(query.order_by(ScoreMatrix.step.desc(), ScoreMatrix.created_at.desc()).limit(1)).first()
    return (row[0], row[1]) if row else None


def l_tok_of(matrix: ScoreMatrix) -> np.ndarray:
    """[R, N] float64 L_tok of a stored matrix."""
    return np.frombuffer(matrix.l_tok, dtype="<f4").astype(np.float64).reshape(matrix.n_rows, matrix.n_columns)
