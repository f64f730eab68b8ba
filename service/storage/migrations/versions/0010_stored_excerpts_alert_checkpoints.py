"""score_matrices.excerpts (cut at scoring time) and alert_checkpoints (the rules' state per run and sampler)

Matrices stored before get NULL excerpts: the heatmap shows none for them rather than parsing
their batch's payload on every read. Runs without a checkpoint replay their history once, at
their next scored step, and resume from the checkpoint written then.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"


def upgrade() -> None:
    with op.batch_alter_table("score_matrices") as batch:
        batch.add_column(sa.Column("excerpts", sa.JSON(), nullable=True))
    op.create_table(
        "alert_checkpoints",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("sampler", sa.String(length=32), nullable=False),
        sa.Column("rules_key", sa.String(length=64), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("state", sa.JSON(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "sampler"),
    )


def downgrade() -> None:
    op.drop_table("alert_checkpoints")
    with op.batch_alter_table("score_matrices") as batch:
        batch.drop_column("excerpts")
