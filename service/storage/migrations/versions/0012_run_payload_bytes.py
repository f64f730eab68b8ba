"""runs.payload_bytes: bytes of a run's stored batch payloads, which max_stored_bytes_per_run bounds (issue 29)

Filled from the payloads already stored.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("payload_bytes", sa.BigInteger(), nullable=False, server_default="0"))
    size = "OCTET_LENGTH(payload)" if op.get_bind().dialect.name == "postgresql" else "LENGTH(CAST(payload AS BLOB))"
    op.execute(f"UPDATE runs SET payload_bytes = (SELECT COALESCE(SUM({size}), 0) FROM batches WHERE run_id = runs.id)")


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("payload_bytes")
