"""The scoring worker: claims queued batches, scores them, writes each batch's results at once.

Durability: a batch is claimed under a lease that a heartbeat renews while it is scored. If the
worker dies, the lease runs out and the batch is claimed again (up to ``max_attempts`` times). A
batch's metric points, EMA states, status and results are written in one transaction, and only
while this worker still holds the lease, so every batch is scored exactly once. A batch that
cannot be scored (bad content, longer than the scorer's context) is marked failed with its reason
and blocks nothing else. Must not import fastapi.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from scoring.estimators import EmaState
from scoring.scorer import Scorer
from service.background import owner_id, poll, retry_through_outage
from service.batch_scoring import score_rollouts
from service.errors import MonitorError
from service.recording import ScoredBatch, load_emas, record_step
from service.runs import RunSnapshot
from service.schemas import BatchIn
from service.scorers import ScorerPool
from service.settings import Settings
from service.storage import queries
from service.storage.database import outage
from service.storage.tables import Batch, Checkpoint, Run

log = logging.getLogger("collapse_monitor.worker")


@dataclass(frozen=True)
class Claimed:
    """A claimed batch and everything scoring it needs, read in the claiming transaction."""

    batch_id: str
    step: int
    payload: str
    run: RunSnapshot
    emas: dict[str, EmaState]
    checkpoint_path: str | None
    checkpoint_kind: str | None


class Worker:
    def __init__(self, sessions: sessionmaker[Session], settings: Settings, pool: ScorerPool) -> None:
        self.sessions = sessions
        self.settings = settings
        self.pool = pool
        self.owner = owner_id()
        self._limits_recorded: set[str] = set()
        self._leased_at = time.monotonic()

    def run(self, stop: threading.Event) -> None:
        """Scores batches until ``stop`` is set; waits ``worker_poll_seconds`` when the queue is empty."""
        log.info("worker %s started", self.owner)
        poll(self.run_once, stop, self.settings.worker_poll_seconds, log, f"worker {self.owner}")

    def run_once(self) -> bool:
        """Claims and scores one batch; False when there was nothing to claim."""
        self._leased_at = time.monotonic()  # no later than the lease's start: bounds the finishing write's retries
        claimed = self._claim()
        if claimed is None:
            return False
        renewing = threading.Event()
        heartbeat = threading.Thread(target=self._heartbeat, args=(claimed.batch_id, renewing), daemon=True)
        heartbeat.start()
        start = time.perf_counter()
        try:
            scored = self._score(claimed)
        except (MonitorError, ValueError) as e:
            reason = str(e)
            self._finish(claimed, lambda: self._finish_failed(claimed, reason))
            return True
        except Exception as e:
            log.exception("worker %s: batch %s failed unexpectedly", self.owner, claimed.batch_id)
            reason = f"internal error while scoring: {type(e).__name__}: {e}"
            self._finish(claimed, lambda: self._finish_failed(claimed, reason))
            return True
        finally:
            renewing.set()
            heartbeat.join()
        seconds = time.perf_counter() - start
        self._finish(claimed, lambda: self._finish_done(claimed, scored, seconds))
        return True

    def _finish(self, claimed: Claimed, write: Callable[[], None]) -> None:
        """A finishing write, retried through a database outage for as long as the lease may still be ours.

        Giving up would leave the batch to be scored again once its lease ran out (a minute). A
        retry never writes twice: ``finish_batch`` writes only while this worker holds the batch,
        and a try whose commit landed released it.
        """
        until = self._leased_at + self.settings.lease_seconds
        retry_through_outage(write, until, log, f"worker {self.owner}: finishing batch {claimed.batch_id}")

    def _claim(self) -> Claimed | None:
        with self.sessions.begin() as session:
            batch = queries.claim_batch(session, self.owner, self.settings.lease_seconds, self.settings.max_attempts)
            if batch is None:
                return None
            run = RunSnapshot.of(session.get_one(Run, batch.run_id))
            checkpoint = session.get(Checkpoint, batch.checkpoint_id) if batch.checkpoint_id else None
            return Claimed(
                batch_id=batch.id,
                step=batch.step,
                payload=batch.payload,
                run=run,
                emas=load_emas(session, run.id, run.samplers),
                checkpoint_path=checkpoint.path if checkpoint else None,
                checkpoint_kind=checkpoint.kind if checkpoint else None,
            )

    def _score(self, claimed: Claimed) -> ScoredBatch:
        payload = BatchIn.model_validate_json(claimed.payload)

        def scorer() -> Scorer:
            path = Path(claimed.checkpoint_path) if claimed.checkpoint_path else None
            loaded = self.pool.get(claimed.run.scorer, path, claimed.checkpoint_kind or "full")
            self._record_limits(claimed.run.scorer, loaded)
            return loaded

        scored = score_rollouts(payload, claimed.run, claimed.emas, scorer, self.settings)
        scored.checkpoint = claimed.checkpoint_path
        return scored

    def _record_limits(self, name: str, scorer: Scorer) -> None:
        """Lets ingest refuse token ids this scorer cannot score (once per scorer and process)."""
        if name in self._limits_recorded:
            return
        try:
            with self.sessions.begin() as session:
                queries.record_scorer_limits(session, name, scorer.vocab_size, scorer.max_positions)
        except SQLAlchemyError as e:
            if outage(e) is None:
                raise
            return  # the database is down: the batch can still be scored; recorded with a later one
        self._limits_recorded.add(name)

    def _heartbeat(self, batch_id: str, done: threading.Event) -> None:
        while not done.wait(self.settings.lease_seconds / 3):
            try:
                with self.sessions.begin() as session:
                    renewed_at = time.monotonic()
                    if not queries.renew_lease(session, batch_id, self.owner, self.settings.lease_seconds):
                        log.warning("worker %s lost the lease of batch %s", self.owner, batch_id)
                        return
                self._leased_at = renewed_at
            except Exception as e:
                if outage(e) is None:
                    log.exception("worker %s: renewing the lease of batch %s failed", self.owner, batch_id)
                else:
                    log.warning(
                        "worker %s: renewing the lease of batch %s: database %s", self.owner, batch_id, outage(e)
                    )

    def _finish_done(self, claimed: Claimed, scored: ScoredBatch, seconds: float) -> None:
        with self.sessions.begin() as session:
            finished = queries.finish_batch(
                session,
                claimed.batch_id,
                self.owner,
                status="done",
                result=scored.result.model_dump(mode="json"),
                scoring_seconds=seconds,
                tokens_scored=scored.tokens,
                scorer=scored.scorer,
                checkpoint=scored.checkpoint,
            )
            if not finished:
                # Another worker holds the batch now (our lease ran out); its results will count.
                log.warning("worker %s: batch %s was taken over; discarding its results", self.owner, claimed.batch_id)
                session.rollback()
                return
            record_step(session, claimed.run, session.get_one(Batch, claimed.batch_id), scored, self.settings)
        log.info("worker %s scored batch %s in %.2fs", self.owner, claimed.batch_id, seconds)

    def _finish_failed(self, claimed: Claimed, reason: str) -> None:
        with self.sessions.begin() as session:
            queries.finish_batch(session, claimed.batch_id, self.owner, status="failed", error=reason)
        log.warning("worker %s: batch %s failed: %s", self.owner, claimed.batch_id, reason)
