"""The scoring worker: claims queued batches, scores them, writes each batch's results at once.

Durability: a batch is claimed under a lease that a heartbeat renews while it is scored. If the
worker dies, the lease runs out and the batch is claimed again (up to ``max_attempts`` times); a
worker restarted under the same name (``loops.worker_identity``) puts its predecessor's
batches back at once instead. A batch's metric points, EMA states, status and results are written
in one transaction, and only while this worker still holds the lease, so every batch is scored
exactly once.

A scorer served elsewhere (vLLM) that does not answer (each request within its total deadline,
``vllm_timeout_seconds``, and its retries) puts the batch back in the queue with that error, which
the API shows while it waits, uncounted, and opens the scorer's circuit breaker (``Breaker``): the
worker claims no batch of that scorer while other scorers' runs are claimed as usual, and probes
the server (``GET /v1/models``, a few seconds' deadline, in a thread of its own: no batch is held)
after ``SCORER_BACKOFF`` (2 s, 4 s, ... 30 s). A probe that is answered half-opens the breaker:
the scorer's batches are claimed again, and the next failure waits the next back-off. The outage
is timed, not counted: once the scorer has been down for ``scorer_outage_seconds`` (from this
worker's first failure), its waiting batches fail with its last error, and so do new ones while it
stays down. ``scorer_outages`` holds what each worker found, for /readyz and /metrics.

Failures: a batch that cannot be scored or stored (bad content, longer than the scorer's context,
a checkpoint that does not load, results the database refuses, longer than
``max_scoring_seconds``) is marked failed at once with its reason and blocks nothing else, since
another try would fail the same way. Only an interruption is retried: a crash (the lease), a
shutdown (released at the next layer, not counted as an attempt), the database going away
(left leased and released, uncounted, by the next round that reaches the database). Must not
import fastapi.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from scoring.estimators import EmaState
from service.errors import MonitorError
from service.jobs.interrupts import BatchDeleted, LeaseLost, ScorerUnavailable, ShuttingDown, TimeLimit, checked
from service.jobs.recording import ScoredBatch, finish_done, finish_failed, load_emas
from service.jobs.rollouts import score_rollouts
from service.jobs.scorers import ScorerPool
from service.jobs.vllm import PROBE_SECONDS, AnyScorer, probe
from service.loops import Backoff, lease_owner, poll, retry_through_outage, worker_identity
from service.schemas.inputs import BatchIn
from service.settings import Settings, VllmEndpoint
from service.snapshot import RunSnapshot
from service.storage import queue, runs, scorer_outages
from service.storage.database import outage
from service.storage.tables import Batch, Checkpoint, Run, utcnow

log = logging.getLogger("collapse_monitor.worker")
# After a scorer's server did not answer (its own retries spent): 2 s, 4 s, ... up to 30 s before the next probe,
# so a server down for minutes is asked twice a minute.
SCORER_BACKOFF = Backoff(first_seconds=2.0, max_seconds=30.0, jitter=0.25)


@dataclass
class Breaker:
    """One scorer's circuit breaker, from its first failure until a batch of it is scored again."""

    error: str  # the last error: the scoring's, then each failed probe's
    down_at: float  # monotonic time of the first failure: the outage's clock
    since: datetime  # the same instant, as recorded for /readyz and /metrics
    probe_at: float  # monotonic time of the next probe
    failures: int = 1  # failures in a row (scorings and probes): the back-off's step
    is_open: bool = True  # False once a probe was answered: its batches are claimed again (half-open)
    answered_at: float | None = None  # monotonic time of the last probe answered
    probing: threading.Thread | None = None
    answer: str | None = None  # the finished probe's: None when the server answered, else why not


@dataclass(frozen=True)
class Claimed:
    """A claimed batch and everything scoring it needs, read after the claim was committed."""

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
        self.name, self._slot = worker_identity(settings.data_dir, settings.worker_name)
        self.owner = lease_owner(self.name)
        self.stop = threading.Event()
        self._limits_recorded: set[str] = set()
        # Leases to put back before the next claim: a dead predecessor's (at start), and this
        # worker's own after a round the database broke off.
        self._release_predecessors = True
        self._release_own = False
        self._leased_at = time.monotonic()
        # The circuit breakers, by scorer name, and what of them is still to be written to scorer_outages
        # (name -> the breaker, or None once its scorer answered); written with the next claim.
        self._breakers: dict[str, Breaker] = {}
        self._outages_to_record: dict[str, Breaker | None] = {}

    def run(self, stop: threading.Event) -> None:
        """Scores batches until ``stop`` is set; waits ``worker_poll_seconds`` when the queue is empty.

        Setting ``stop`` also abandons the batch being scored at its next layer and puts it back
        in the queue, so a shutdown takes seconds, not the rest of a long batch.
        """
        self.stop = stop
        log.info("worker %s started", self.owner)
        try:
            poll(self.run_once, stop, self.settings.worker_poll_seconds, log, f"worker {self.owner}")
        finally:
            self.close()

    def close(self) -> None:
        """Gives up this worker's name (a later worker of this host may take it) and its scorers' connections."""
        self.pool.close()
        if self._slot is not None:
            os.close(self._slot)
            self._slot = None

    def run_once(self) -> bool:
        """Claims and scores one batch; False when there was nothing to claim."""
        self._release_leftovers()
        if self.stop.is_set():
            return False
        self._leased_at = time.monotonic()  # no later than the lease's start: bounds the finishing write's retries
        batch_id = self._claim()
        if batch_id is None:
            return False
        try:
            self._process(batch_id)
        except Exception as e:
            if outage(e) is not None:  # the batch stays leased to this worker: put it back once the database answers
                self._release_own = True
            raise
        return True

    def _process(self, batch_id: str) -> None:
        lost = threading.Event()
        renewing = threading.Event()
        heartbeat = threading.Thread(target=self._heartbeat, args=(batch_id, renewing, lost), daemon=True)
        heartbeat.start()
        start = time.perf_counter()
        claimed: Claimed | None = None
        try:
            claimed = self._load(batch_id)
            scored = self._score(claimed, self._interrupter(start, lost))
        except ShuttingDown:
            self._put_back(batch_id)
            return
        except ScorerUnavailable as e:
            if claimed is not None:
                self._scorer_failed(claimed.run.scorer, str(e))
            self._put_back(batch_id, str(e))
            return
        except BatchDeleted:
            log.info("worker %s: batch %s was deleted with its run; nothing to score", self.owner, batch_id)
            return
        except LeaseLost:
            log.warning("worker %s: batch %s was taken over; abandoning it", self.owner, batch_id)
            return
        except Exception as e:
            if outage(e) is not None:
                raise
            reason = self._reason(batch_id, e)
            self._finish(batch_id, lambda: self._finish_failed(batch_id, reason))
            return
        finally:
            renewing.set()
            heartbeat.join()
        if self._breakers.pop(claimed.run.scorer, None) is not None:  # it answered: closed again
            self._outages_to_record[claimed.run.scorer] = None
        seconds = time.perf_counter() - start
        try:
            self._finish(batch_id, lambda: self._finish_done(claimed, scored, seconds))
        except Exception as e:
            if outage(e) is not None:
                raise
            # The same rows would be refused again: a retry would only hold the run's later steps.
            log.exception("worker %s: the results of batch %s could not be stored", self.owner, batch_id)
            reason = f"scored, but the results could not be stored: {type(e).__name__}: {e}"
            self._finish(batch_id, lambda: self._finish_failed(batch_id, reason))

    def _finish(self, batch_id: str, write: Callable[[], None]) -> None:
        """A finishing write, retried through a database outage for as long as the lease may still be ours.

        Giving up would leave the batch to be scored again once its lease ran out. A retry never
        writes twice: ``finish_batch`` writes only while this worker holds the batch, and a try
        whose commit landed released it.
        """
        until = self._leased_at + self.settings.lease_seconds
        retry_through_outage(write, until, log, f"worker {self.owner}: finishing batch {batch_id}")

    def _reason(self, batch_id: str, error: Exception) -> str:
        """Why a batch failed, for its ``error``: the message of an expected failure, else the exception."""
        if isinstance(error, MonitorError | ValueError | TimeLimit):  # content, scorer limits, loading, time
            return str(error)
        log.exception("worker %s: batch %s failed unexpectedly", self.owner, batch_id, exc_info=error)
        return f"internal error while scoring: {type(error).__name__}: {error}"

    def _interrupter(self, start: float, lost: threading.Event) -> Callable[[], None]:
        """The check the kernel calls between layers: shutdown, a lost lease, the time limit."""
        limit = self.settings.max_scoring_seconds

        def check() -> None:
            if self.stop.is_set():
                raise ShuttingDown
            if lost.is_set():
                raise LeaseLost
            elapsed = time.perf_counter() - start
            if elapsed > limit:
                raise TimeLimit(
                    f"scoring was stopped after {elapsed:.1f} s: longer than max_scoring_seconds={limit:g}; "
                    "send smaller batches (fewer groups, a smaller num_samples) or raise the limit"
                )

        return check

    def _release_leftovers(self) -> None:
        if not (self._release_own or self._release_predecessors):
            return
        with self.sessions.begin() as session:
            # Own leases first: the predecessors' prefix (the name) matches them too, and they must not count.
            own = queue.release_leases(session, self.owner, count_attempt=False) if self._release_own else []
            dead = (
                queue.release_leases(session, f"{self.name}#", count_attempt=True) if self._release_predecessors else []
            )
        self._release_own = self._release_predecessors = False
        for batch_id in own:
            log.info("worker %s: put batch %s back after a database outage", self.owner, batch_id)
        for batch_id in dead:
            log.warning(
                "worker %s: batch %s was being scored when %s stopped; scoring it again",
                self.owner,
                batch_id,
                self.name,
            )

    def _put_back(self, batch_id: str, scorer_down: str | None = None) -> None:
        """Puts the batch back, uncounted: at shutdown; with the error kept on it when ``scorer_down`` says
        its scorer's server is away.

        An outage is not counted: ``max_attempts`` is for crashes, which the batch itself may cause and
        which a count bounds; an outage says nothing of the batch, and a count would turn the breaker's
        back-off into a deadline no one chose (3 tries fail a batch within a minute of a vLLM restart).
        ``scorer_outage_seconds`` bounds it instead, in time.
        """
        with self.sessions.begin() as session:
            queue.release_leases(session, self.owner, count_attempt=False, error=scorer_down)
            recorded = self._record_outages(session)
        self._recorded(recorded)
        if scorer_down is None:
            log.info("worker %s: stopping; batch %s is back in the queue", self.owner, batch_id)
        else:
            log.warning("worker %s: batch %s is back in the queue: %s", self.owner, batch_id, scorer_down)

    def _claim(self) -> str | None:
        """The next batch, passing over the runs of scorers whose breaker is open, failing those of scorers
        down for longer than ``scorer_outage_seconds``."""
        self._probe_scorers()
        now = time.monotonic()
        limit = self.settings.scorer_outage_seconds
        down = [name for name, b in self._breakers.items() if b.is_open and now - b.down_at < limit]
        give_up = {
            name: f"scorer {name!r} has not answered for {now - b.down_at:.0f} s (scorer_outage_seconds={limit:g}); "
            f"giving up. Its last error: {b.error}"
            for name, b in self._breakers.items()
            if b.is_open and now - b.down_at >= limit
        }
        with self.sessions.begin() as session:
            recorded = self._record_outages(session)
            batch = queue.claim_batch(
                session,
                self.owner,
                self.settings.lease_seconds,
                self.settings.max_attempts,
                skip_scorers=down,
                give_up=give_up,
            )
            claimed = batch.id if batch is not None else None
        self._recorded(recorded)
        return claimed

    def _record_outages(self, session: Session) -> list[str]:
        """Writes the breakers' changes to ``scorer_outages``; the caller forgets the names returned once
        committed (a failed commit leaves them to the next transaction; only this thread changes them)."""
        for name, breaker in self._outages_to_record.items():
            if breaker is None:
                scorer_outages.note_up(session, name)
            else:
                scorer_outages.note_down(session, name, breaker.since, breaker.error)
        return list(self._outages_to_record)

    def _recorded(self, names: list[str]) -> None:
        for name in names:
            self._outages_to_record.pop(name, None)

    def _scorer_failed(self, name: str, error: str) -> None:
        """Opens ``name``'s breaker (again): a scoring or a probe found its server not answering."""
        now = time.monotonic()
        breaker = self._breakers.get(name)
        # Answered, then no failure for scorer_outage_seconds: that outage is over, this is a new one.
        if breaker is None or (
            breaker.answered_at is not None and now - breaker.answered_at > self.settings.scorer_outage_seconds
        ):
            breaker = self._breakers[name] = Breaker(error, down_at=now, since=utcnow(), probe_at=now)
        else:
            breaker.failures += 1
            breaker.error, breaker.is_open = error, True
        breaker.probe_at = now + SCORER_BACKOFF.delay(breaker.failures)
        self._outages_to_record[name] = breaker

    def _probe_scorers(self) -> None:
        """Reads the probes that finished and starts those that are due, each in a thread of its own."""
        now = time.monotonic()
        for name, breaker in list(self._breakers.items()):
            if not breaker.is_open:
                continue
            if breaker.probing is not None:
                if breaker.probing.is_alive():
                    continue
                breaker.probing = None
                if breaker.answer is None:
                    log.info("worker %s: scorer %s answers again; claiming its batches", self.owner, name)
                    # Half-open: the outage's clock and back-off step stay until a batch of it is scored, so a
                    # server whose /v1/models answers while its completions hang still fails its batches in time.
                    breaker.is_open, breaker.answered_at = False, now
                    self._outages_to_record[name] = None
                    continue
                self._scorer_failed(name, breaker.answer)
                log.warning("worker %s: %s", self.owner, breaker.answer)
            if breaker.probe_at <= now:
                breaker.probing = threading.Thread(
                    target=self._probe, args=(name, breaker), name=f"probe-{name}", daemon=True
                )
                breaker.probing.start()

    def _probe(self, name: str, breaker: Breaker) -> None:
        endpoint = VllmEndpoint.parse(self.settings.scorers.get(name, ""))
        if endpoint is None:  # not a vLLM scorer (any more): nothing to wait for
            breaker.answer = None
            return
        seconds = min(PROBE_SECONDS, self.settings.vllm_timeout_seconds)
        reason = probe(endpoint, seconds)
        where = f"scorer {name!r}: the vLLM server at {endpoint.url}"
        breaker.answer = None if reason is None else f"{where} did not answer the probe GET /v1/models ({reason})"

    def _load(self, batch_id: str) -> Claimed:
        # Read after the claim's commit: a run or checkpoint that cannot be read fails its batch,
        # where failing inside the claim would roll the claim back and retry it forever.
        with self.sessions.begin() as session:
            batch = session.get(Batch, batch_id)
            if batch is None:  # DELETE /v1/runs/{run} came between the claim and this read
                raise BatchDeleted
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

    def _score(self, claimed: Claimed, check: Callable[[], None]) -> ScoredBatch:
        payload = BatchIn.model_validate_json(claimed.payload)

        def scorer() -> AnyScorer:
            path = Path(claimed.checkpoint_path) if claimed.checkpoint_path else None
            loaded = checked(lambda: self.pool.get(claimed.run.scorer, path, claimed.checkpoint_kind or "full"), check)
            self._record_limits(claimed.run.scorer, loaded)
            return loaded

        scored = score_rollouts(payload, claimed.run, claimed.emas, scorer, self.settings, check, self.pool.rates)
        scored.checkpoint = claimed.checkpoint_path
        return scored

    def _record_limits(self, name: str, scorer: AnyScorer) -> None:
        """Lets ingest refuse token ids this scorer cannot score (once per scorer and process)."""
        if name in self._limits_recorded:
            return
        try:
            with self.sessions.begin() as session:
                runs.record_scorer_limits(session, name, scorer.vocab_size, scorer.max_positions)
        except SQLAlchemyError as e:
            if outage(e) is None:
                raise
            return  # the database is down: the batch can still be scored; recorded with a later one
        self._limits_recorded.add(name)

    def _heartbeat(self, batch_id: str, done: threading.Event, lost: threading.Event) -> None:
        while not done.wait(self.settings.lease_seconds / 3):
            try:
                with self.sessions.begin() as session:
                    renewed_at = time.monotonic()
                    if not queue.renew_lease(session, batch_id, self.owner, self.settings.lease_seconds):
                        log.warning("worker %s lost the lease of batch %s", self.owner, batch_id)
                        lost.set()
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
            if not finish_done(session, claimed.run, claimed.batch_id, self.owner, scored, seconds, self.settings):
                # Another worker holds the batch now (our lease ran out); its results will count.
                log.warning("worker %s: batch %s was taken over; discarding its results", self.owner, claimed.batch_id)
                session.rollback()
                return
        log.info("worker %s scored batch %s in %.2fs", self.owner, claimed.batch_id, seconds)

    def _finish_failed(self, batch_id: str, reason: str) -> None:
        with self.sessions.begin() as session:
            finish_failed(session, batch_id, self.owner, reason, self.settings)
        log.warning("worker %s: batch %s failed: %s", self.owner, batch_id, reason)
