"""runs.last_claimed_at: when a worker last took one of the run's batches (round-robin claiming)

Runs created before get NULL, which counts as never served: each is served once before the
round-robin order takes over.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("last_claimed_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("last_claimed_at")
