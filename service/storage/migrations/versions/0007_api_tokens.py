"""API tokens, the token that created a run, and purged payloads

``api_tokens`` holds bearer tokens (only the SHA-256 of each secret); ``runs.created_by_token``
lets ``max_runs_per_token`` count an ingest token's runs; ``batches.payload_purged_at`` marks a
batch whose payload ``payload_retention_days`` (or ``collapse-monitor purge``) removed.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("run_prefix", sa.String(length=200), nullable=False),
        sa.Column("secret_sha256", sa.String(length=64), nullable=False),
        sa.Column("hint", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("secret_sha256"),
    )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("created_by_token", sa.Integer(), nullable=True))
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("payload_purged_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("payload_purged_at")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("created_by_token")
    op.drop_table("api_tokens")
