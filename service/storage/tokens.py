"""API tokens in storage: issue, list, revoke, look up by digest. Functions of a Session, like ``queries``.

Must not import fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.storage.tables import ApiToken, Run, utcnow


def add_token(session: Session, scope: str, run_prefix: str, name: str | None, digest: str, hint: str) -> ApiToken:
    token = ApiToken(scope=scope, run_prefix=run_prefix, name=name, secret_sha256=digest, hint=hint)
    session.add(token)
    session.flush()
    return token


def list_tokens(session: Session) -> Sequence[ApiToken]:
    return session.scalars(select(ApiToken).order_by(ApiToken.id)).all()


def token_by_digest(session: Session, digest: str) -> ApiToken | None:
    return session.scalar(select(ApiToken).where(ApiToken.secret_sha256 == digest))


def revoke_token(session: Session, token_id: int) -> ApiToken | None:
    """Marks the token revoked (kept, so that its use is told apart from a made-up token); None if unknown."""
    token = session.get(ApiToken, token_id)
    if token is not None and token.revoked_at is None:
        token.revoked_at = utcnow()
    return token


def active_token_count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(ApiToken).where(ApiToken.revoked_at.is_(None))) or 0)


def runs_created_by(session: Session, token_id: int, *, lock: bool = False) -> int:
    """Runs the token created; with ``lock`` the token's row is locked first (Postgres), so that
    concurrent creations with one token count one after the other."""
    if lock and session.get_bind().dialect.name == "postgresql":
        session.execute(select(ApiToken.id).where(ApiToken.id == token_id).with_for_update())
    return int(session.scalar(select(func.count()).select_from(Run).where(Run.created_by_token == token_id)) or 0)
