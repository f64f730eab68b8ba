"""The batch queue: replay lookups, depths, claims under a lease, renewals, releases, finishes; scoring totals.

Plain functions of a Session; callers own the transaction (``with session.begin():``). Must not import
fastapi.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from sqlalchemy import and_, case, exists, func, or_, select, true, update
from sqlalchemy.orm import Session

from service.storage.clock import db_time
from service.storage.runs import newest_step
from service.storage.tables import Batch, Run


def batch_counts(session: Session, run_id: int | None = None) -> dict[str, int]:
    query = select(Batch.status, func.count()).group_by(Batch.status)
    if run_id is not None:
        query = query.where(Batch.run_id == run_id)
    return {status: int(n) for status, n in session.execute(query).all()}


def batch_counts_of(session: Session, run_ids: Sequence[int]) -> dict[int, dict[str, int]]:
    """run id -> status -> batches, for the runs ``run_ids`` (one query)."""
    out: dict[int, dict[str, int]] = {}
    query = select(Batch.run_id, Batch.status, func.count()).where(Batch.run_id.in_(run_ids))
    for run_id, status, n in session.execute(query.group_by(Batch.run_id, Batch.status)).all():
        out.setdefault(int(run_id), {})[status] = int(n)
    return out


def batch_by_key(session: Session, run_id: int, idempotency_key: str) -> Batch | None:
    return session.scalar(select(Batch).where(Batch.run_id == run_id, Batch.idempotency_key == idempotency_key))


def batch_by_content(session: Session, run_id: int, step: int, payload_sha256: str) -> Batch | None:
    """An earlier batch of this run and step with byte-identical content."""
    return session.scalar(
        select(Batch)
        .where(Batch.run_id == run_id, Batch.step == step, Batch.payload_sha256 == payload_sha256)
        .order_by(Batch.created_at)
        .limit(1)
    )


def newest_batch_of_step(session: Session, run_id: int, step: int, segment: int) -> Batch | None:
    """The batch of ``step`` in ``segment`` received last (a step sent again with other content is a new batch)."""
    return session.scalar(
        select(Batch)
        .where(Batch.run_id == run_id, Batch.step == step, Batch.segment == segment)
        .order_by(Batch.created_at.desc(), Batch.id.desc())
        .limit(1)
    )


def queue_depth(session: Session, run_id: int | None = None) -> int:
    """Batches waiting to be scored: all of them, or one run's."""
    query = select(func.count()).select_from(Batch).where(Batch.status == "queued")
    if run_id is not None:
        query = query.where(Batch.run_id == run_id)
    return int(session.scalar(query) or 0)


def token_queue_depth(session: Session, token_id: int) -> int:
    """Batches waiting to be scored in the runs the token ``token_id`` created (at most the whole queue's)."""
    query = (
        select(func.count())
        .select_from(Batch)
        .join(Run, Run.id == Batch.run_id)
        .where(Batch.status == "queued", Run.created_by_token == token_id)
    )
    return int(session.scalar(query) or 0)


def _claimable(now: Any) -> Any:
    # Queued, or claimed by a worker whose lease ran out (it crashed or was killed).
    return or_(Batch.status == "queued", and_(Batch.status == "scoring", Batch.lease_expires_at <= now))


def _is(column: Any, value: Any) -> Any:
    return column.is_(None) if value is None else column == value


# The claiming group of a run: the token that created it; 0 for the runs created without one (ids start at 1).
_token_group = func.coalesce(Run.created_by_token, 0)


# A claim that loses this many races in a row (each one: a batch another worker finished, renewed,
# released or took between the claim's read and its write) returns None; the worker polls again.
MAX_LOST_CLAIMS = 8


def claim_batch(
    session: Session,
    owner: str,
    lease_seconds: float,
    max_attempts: int,
    skip_scorers: Collection[str] = (),
    give_up: Mapping[str, str] | None = None,
) -> Batch | None:
    """Claims the next batch to score: round-robin across tokens, then across their runs, step order within a run.

    Runs are grouped by the ingest token that created them (runs created without one form one
    group). Among the runs with a claimable batch and none being scored, those of the group served
    least recently go first, and among them the run claimed least recently (a group or run never
    served before all others, then the oldest waiting batch): a token that queued 200 batches
    over 10 runs takes turns with a token that posted one batch, and a run with 200 queued
    batches with a run that posted one. Within a run batches are scored one at a time in step
    order, so the EMA of each (run, sampler) advances in order. The choice reads each run row
    once (the groups' last service is one grouped pass over ``runs``), whatever the queue holds.
    On Postgres the run row is locked with SKIP LOCKED, so concurrent workers claim different
    runs without waiting on each other; a batch whose lease expired is claimed again. A batch
    interrupted ``max_attempts`` times is marked failed instead of looping forever. Runs of a scorer
    in ``skip_scorers`` (one whose server is down) are passed over, so their batches wait without
    holding the others'; the batches of a scorer in ``give_up`` (down for too long) are marked
    failed with its message instead of claimed.

    The claim is a compare-and-set: its UPDATE changes the batch only if it still is as it was
    read (status, lease owner, lease expiry, attempts) and still claimable by the database's
    clock. A worker whose lease ran out while it was slow may commit its ``done`` between the
    read and the write: the write then changes nothing, and the claim moves on, where writing by
    primary key alone would have put the finished batch back to ``scoring`` (and scored it twice).
    """
    now = db_time()
    # When each token's group of runs was last served: the newest claim of any of its runs.
    served = (
        select(_token_group.label("token"), func.max(Run.last_claimed_at).label("at")).group_by(_token_group).subquery()
    )
    lost = 0
    while lost < MAX_LOST_CLAIMS:
        claimable = _claimable(now)
        busy = exists().where(Batch.run_id == Run.id, Batch.status == "scoring", Batch.lease_expires_at > now)
        oldest = select(func.min(Batch.created_at)).where(Batch.run_id == Run.id, claimable).scalar_subquery()
        runs = (
            select(Run.id, Run.scorer)
            .join(served, served.c.token == _token_group)
            .where(exists().where(Batch.run_id == Run.id, claimable), ~busy)
            .where(Run.scorer.not_in(skip_scorers) if skip_scorers else true())
            .order_by(served.c.at.asc().nulls_first(), Run.last_claimed_at.asc().nulls_first(), oldest, Run.id)
            .limit(1)
        )
        if session.get_bind().dialect.name == "postgresql":
            # FOR NO KEY UPDATE: it still keeps other claims (and a delete) off the run, but not the
            # rows that only reference it: a worker finishing one of the run's batches (an expired
            # lease this claim is looking at) writes its points meanwhile instead of deadlocking.
            runs = runs.with_for_update(of=Run, skip_locked=True, key_share=True)
        chosen = session.execute(runs).one_or_none()
        if chosen is None:
            return None
        run_id, scorer = chosen
        seen = session.execute(
            select(Batch.id, Batch.status, Batch.lease_owner, Batch.lease_expires_at, Batch.attempts)
            .where(Batch.run_id == run_id, claimable)
            .order_by(Batch.segment, Batch.step, Batch.created_at)
            .limit(1)
        ).one_or_none()
        if seen is None:  # finished or deleted since the run was chosen
            lost += 1
            continue
        as_read = and_(
            Batch.id == seen.id,
            Batch.status == seen.status,
            _is(Batch.lease_owner, seen.lease_owner),
            _is(Batch.lease_expires_at, seen.lease_expires_at),
            Batch.attempts == seen.attempts,
            claimable,
        )
        # Either way the claim counts an attempt, and writes only if the batch is still as read.
        take = update(Batch).where(as_read).values(attempts=Batch.attempts + 1)
        if give_up and scorer in give_up:
            error: str | None = give_up[scorer]
        elif seen.attempts + 1 > max_attempts:
            error = f"scoring was interrupted {max_attempts} times (worker crashed or was killed); giving up"
        else:
            error = None
        if error is not None:
            failed = session.execute(
                take.values(
                    status="failed", finished_at=now, error=error, lease_owner=None, lease_expires_at=None
                ).execution_options(synchronize_session=False)
            )
            if not failed.rowcount:  # type: ignore[attr-defined]  # CursorResult of an UPDATE
                lost += 1  # changed by someone else meanwhile: look again
            continue
        batch = session.scalar(
            take.values(status="scoring", lease_owner=owner, lease_expires_at=db_time(lease_seconds), started_at=now)
            .returning(Batch)
            .execution_options(synchronize_session=False, populate_existing=True)
        )
        if batch is None:  # lost the race: the batch changed between the read and this write
            lost += 1
            continue
        session.execute(
            update(Run)
            .where(Run.id == run_id)
            .values(
                last_claimed_at=now,
                claimed_step=case(
                    (Run.segment == batch.segment, newest_step(Run.claimed_step, batch.step)), else_=Run.claimed_step
                ),
            )
            .execution_options(synchronize_session=False)
        )
        return batch
    return None


def release_leases(session: Session, owner_prefix: str, *, count_attempt: bool, error: str | None = None) -> list[str]:
    """Puts the batches whose lease owner starts with ``owner_prefix`` back in the queue at once.

    ``count_attempt``: whether the interrupted scoring counts towards ``max_attempts`` (it does
    when the worker crashed, which the batch itself may have caused; not on a shutdown or when
    the database was away). ``error``, when given, is kept on the queued batch: why it waits (its
    scorer's server did not answer), shown by the API until the batch is scored. Returns the ids
    released. One UPDATE whose condition is the lease
    itself (still scoring, still this owner's), so a batch finished or taken over meanwhile is
    left alone.
    """
    released = list(
        session.scalars(
            update(Batch)
            .where(Batch.status == "scoring", Batch.lease_owner.startswith(owner_prefix, autoescape=True))
            .values(
                status="queued",
                lease_owner=None,
                lease_expires_at=None,
                attempts=Batch.attempts if count_attempt else Batch.attempts - 1,
                **({"error": error} if error is not None else {}),
            )
            .returning(Batch.id)
            .execution_options(synchronize_session=False)
        )
    )
    return released


def renew_lease(session: Session, batch_id: str, owner: str, lease_seconds: float) -> bool:
    """Extends the lease by ``lease_seconds`` from now (the database's clock); False if it is not ``owner``'s."""
    result = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.lease_owner == owner, Batch.status == "scoring")
        .values(lease_expires_at=db_time(lease_seconds))
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]  # CursorResult of an UPDATE


def finish_batch(
    session: Session,
    batch_id: str,
    owner: str | None,
    *,
    status: str,
    error: str | None = None,
    result: dict[str, Any] | None = None,
    scoring_seconds: float | None = None,
    tokens_scored: int | None = None,
    scorer: str | None = None,
    checkpoint: str | None = None,
) -> bool:
    """Marks a batch done or failed, but only if ``owner`` still holds it (None: not leased).

    False means another worker took the batch over; the caller must roll back. The lease is the
    UPDATE's own condition: on Postgres a claim racing this write waits for its row lock and then
    finds the batch no longer claimable; on SQLite writers take turns.
    """
    holder = (
        and_(Batch.lease_owner == owner, Batch.status == "scoring")
        if owner is not None
        else Batch.lease_owner.is_(None)
    )
    changed = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, holder)
        .values(
            status=status,
            error=error,
            result=result,
            scoring_seconds=scoring_seconds,
            tokens_scored=tokens_scored,
            scorer=scorer,
            checkpoint=checkpoint,
            finished_at=db_time(),
            lease_owner=None,
            lease_expires_at=None,
        )
        .execution_options(synchronize_session=False)
    )
    return bool(changed.rowcount)  # type: ignore[attr-defined]  # CursorResult of an UPDATE


def scoring_stats(session: Session, buckets: Sequence[float]) -> dict[str, Any]:
    """Totals over finished batches: counts per status, how many took at most each of ``buckets`` seconds
    (a histogram's cumulative counts), tokens."""
    counts = [func.sum(case((Batch.scoring_seconds <= bound, 1), else_=0)) for bound in buckets]
    row = session.execute(
        select(
            func.count(Batch.scoring_seconds),
            func.coalesce(func.sum(Batch.scoring_seconds), 0.0),
            func.coalesce(func.sum(Batch.tokens_scored), 0),
            *counts,
        ).where(Batch.status == "done", Batch.scoring_seconds.is_not(None))
    ).one()
    recent = session.execute(
        select(Batch.tokens_scored, Batch.scoring_seconds)
        .where(Batch.status == "done", Batch.tokens_scored > 0)
        .order_by(Batch.finished_at.desc())
        .limit(20)
    ).all()
    pairs = [(int(t or 0), float(s or 0.0)) for t, s in recent]
    seconds = sum(s for _, s in pairs)
    return {
        "count": int(row[0]),
        "sum_seconds": float(row[1]),
        "tokens": int(row[2]),
        "buckets": [int(v or 0) for v in row[3:]],
        "recent_tokens_per_second": sum(t for t, _ in pairs) / seconds if seconds > 0 else None,
    }
