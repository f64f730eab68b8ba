"""runs.reasoning_extraction: where a turn's response holds its reasoning

Runs created before this setting existed get ``auto``: for turns with think tags it reads them as
``think_tags`` did, and turns without tags, which scored nothing before, now score their whole
response. A trainer re-posting its run without the field (default ``auto``) still matches.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("reasoning_extraction", sa.String(16), nullable=False, server_default="auto"))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("reasoning_extraction")
