"""API tokens in storage: issue, list, revoke, look up by digest. Functions of a Session, like ``queries``.

Must not import fastapi.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.storage.database import dialect_insert
from service.storage.tables import ACCESS_STATE_ID, AccessState, ApiToken, Run, utcnow


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


def runs_created_by(session: Session, token_id: int | None, *, lock: bool = False) -> int:
    """Runs the token created (None: created without one); with ``lock`` the token's row is locked first
    (Postgres), so that concurrent creations with one token count one after the other."""
    if lock and token_id is not None and session.get_bind().dialect.name == "postgresql":
        session.execute(select(ApiToken.id).where(ApiToken.id == token_id).with_for_update())
    creator = Run.created_by_token.is_(None) if token_id is None else Run.created_by_token == token_id
    return int(session.scalar(select(func.count()).select_from(Run).where(creator)) or 0)


def is_last_admin(session: Session, token_id: int) -> bool:
    """Whether the token is the only unrevoked admin token (revoking it leaves no one who may delete runs)."""
    token = session.get(ApiToken, token_id)
    if token is None or token.scope != "admin" or token.revoked_at is not None:
        return False
    admins = select(func.count()).select_from(ApiToken).where(ApiToken.revoked_at.is_(None), ApiToken.scope == "admin")
    return int(session.scalar(admins) or 0) == 1


def record_tokens_issued(session: Session) -> None:
    """Keeps, for good, that this database issues tokens (``auth: auto`` then needs one for every write).

    One row, written with the first token; kept apart from ``api_tokens`` so that revoking or
    deleting every token does not reopen writes.
    """
    if session.get(AccessState, ACCESS_STATE_ID) is None:
        # Concurrent first tokens: the second insert does nothing rather than fail.
        session.execute(dialect_insert(session, AccessState).values(id=ACCESS_STATE_ID).on_conflict_do_nothing())


def tokens_were_issued(session: Session) -> bool:
    """Whether any token was ever issued here (the kept fact, or a token row from before it was kept)."""
    recorded = session.scalar(select(AccessState.id).where(AccessState.id == ACCESS_STATE_ID))
    return recorded is not None or session.scalar(select(ApiToken.id).limit(1)) is not None
