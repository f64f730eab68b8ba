"""access_state: the kept fact that this database issues API tokens

With ``auth: auto`` every write needs a token once one was ever issued; that fact lives in its
own one-row table, so that revoking every token (or emptying ``api_tokens``) does not reopen
writes. A database that already holds tokens gets the row now, dated by its first token.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"


def upgrade() -> None:
    op.create_table(
        "access_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tokens_issued_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.execute(
        "INSERT INTO access_state (id, tokens_issued_at) SELECT 1, MIN(created_at) FROM api_tokens HAVING COUNT(*) > 0"
    )


def downgrade() -> None:
    op.drop_table("access_state")
