"""Indexes for the pace read (``service.reads.pace``): a run's newest accepted and newest finished batches

Without them each scheduled post sorted the run's whole batch history (~94 ms at 1,000 batches on
SQLite); with them it reads its last few rows whatever the history. ``ix_batches_run_step`` gains
``created_at``, so that a replay's lookup (the first batch of a step with the same content, by
``created_at``) keeps to its step's rows rather than walking the run's history in the new order.
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"


def upgrade() -> None:
    op.drop_index("ix_batches_run_step", table_name="batches")
    op.create_index("ix_batches_run_step", "batches", ["run_id", "step", "created_at"])
    op.create_index("ix_batches_run_created", "batches", ["run_id", "created_at"])
    op.create_index("ix_batches_run_status_finished", "batches", ["run_id", "status", "finished_at"])


def downgrade() -> None:
    op.drop_index("ix_batches_run_status_finished", table_name="batches")
    op.drop_index("ix_batches_run_created", table_name="batches")
    op.drop_index("ix_batches_run_step", table_name="batches")
    op.create_index("ix_batches_run_step", "batches", ["run_id", "step"])
