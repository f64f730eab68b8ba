"""Resume segments of runs, scorer limits, and the index that finds a keyless replay

A trainer that resumes from an earlier checkpoint (or a script re-run under the same name) sends
a step below one already scored: the run starts a new segment whose series replace the older ones
from its first step on. ``scorer_limits`` records each loaded scorer's vocabulary and context so
that ingest refuses token ids it cannot score. ``ix_batches_run_step`` finds an identical replay
of a batch sent without an idempotency key.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"

SEGMENTED = ("batches", "metric_points", "latest_metrics")


def upgrade() -> None:
    with op.batch_alter_table("runs") as table:
        table.add_column(sa.Column("segment", sa.Integer(), nullable=False, server_default="0"))
        table.add_column(sa.Column("claimed_step", sa.Integer(), nullable=True))
    for name in SEGMENTED:
        with op.batch_alter_table(name) as table:
            table.add_column(sa.Column("segment", sa.Integer(), nullable=False, server_default="0"))
    # Existing runs continue their one segment from the newest step taken for scoring.
    op.execute(
        "UPDATE runs SET claimed_step = (SELECT MAX(step) FROM batches "
        "WHERE batches.run_id = runs.id AND batches.status <> 'queued')"
    )
    op.create_index("ix_batches_run_step", "batches", ["run_id", "step"])
    op.create_table(
        "scorer_limits",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("vocab_size", sa.Integer(), nullable=False),
        sa.Column("max_positions", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("scorer_limits")
    op.drop_index("ix_batches_run_step", table_name="batches")
    for name in SEGMENTED:
        with op.batch_alter_table(name) as table:
            table.drop_column("segment")
    with op.batch_alter_table("runs") as table:
        table.drop_column("claimed_step")
        table.drop_column("segment")
