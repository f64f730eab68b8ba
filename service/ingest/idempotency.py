"""Idempotency: a batch row under a fresh id, and replays.

An identical earlier request is answered as the first time; other content under the same key is a 409.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from service.errors import Conflict
from service.reads.runs import require_run
from service.schemas.inputs import BatchAccepted
from service.storage import queue
from service.storage.tables import Batch


def content_hash(raw: bytes) -> str:
    """SHA-256 of the body as sent: a retried request matches at the cost of one pass over its bytes."""
    return hashlib.sha256(raw).hexdigest()


def same_content(
    stored_payload: str, stored_hash: str, raw: bytes, is_purged: bool = False, digest: str | None = None
) -> bool:
    """Whether a replayed body carries the stored content; key order and spacing do not matter,
    except once the stored payload was purged (retention): then only the hash of the bytes is left.
    ``digest``: ``content_hash(raw)`` when the caller has it."""
    if (digest or content_hash(raw)) == stored_hash:
        return True
    if is_purged:
        return False
    try:
        return bool(json.loads(stored_payload) == json.loads(raw))
    except json.JSONDecodeError:  # pragma: no cover - both bodies were validated JSON
        return False


def new_batch(
    run_id: int, step: int, segment: int, key: str | None, kind: str, raw: bytes, digest: str, **fields: Any
) -> Batch:
    """A batch row holding the request body as sent (``digest``: its ``content_hash``), under a fresh id."""
    return Batch(
        id=uuid.uuid4().hex,
        run_id=run_id,
        step=step,
        segment=segment,
        idempotency_key=key,
        kind=kind,
        payload=raw.decode(),
        payload_sha256=digest,
        **fields,
    )


def accepted_answer(batch: Batch, replayed: bool = False) -> BatchAccepted:
    return BatchAccepted(
        batch_id=batch.id,
        status=batch.status,  # type: ignore[arg-type]  # the column only ever holds a BatchState
        status_url=f"/v1/batches/{batch.id}",
        replayed=replayed,
        segment=batch.segment,
    )


def replay_of(
    session: Session, run_id: int, key: str | None, step: int, raw: bytes, digest: str
) -> BatchAccepted | None:
    """The first answer to an identical earlier request; 409 for other content under the same key.

    Without a key, an earlier batch of the same step with byte-identical content is a replay too
    (a client that retried after a lost answer).
    """
    if key is None:
        existing = queue.batch_by_content(session, run_id, step, digest)
        return accepted_answer(existing, replayed=True) if existing is not None else None
    existing = queue.batch_by_key(session, run_id, key)
    if existing is None:
        return None
    is_purged = existing.payload_purged_at is not None
    if not same_content(existing.payload, existing.payload_sha256, raw, is_purged, digest):
        purged = " (its payload was purged, so only a byte-identical replay is recognised)" if is_purged else ""
        raise Conflict(
            f"batch_id {key!r} was already used for different content (batch {existing.id}){purged}; "
            "send new content under a new batch_id",
            field="batch_id",
        )
    return accepted_answer(existing, replayed=True)


def replay_after_race(
    sessions: sessionmaker[Session], run_name: str, key: str | None, step: int, raw: bytes, digest: str
) -> BatchAccepted:
    with sessions.begin() as session:
        replay = replay_of(session, require_run(session, run_name).id, key, step, raw, digest)
    if replay is None:  # pragma: no cover - the unique constraint fired, so the row exists
        raise Conflict("batch_id conflict", field="batch_id")
    return replay
