"""Tables (SQLAlchemy 2.0 declarative). The same Alembic migrations create them on SQLite and Postgres."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# The clock and the time format every answer uses live in times.py (torch- and SQLAlchemy-free, for schemas);
# named here too, where the rows' callers have always imported them.
from service.storage.times import as_utc as as_utc
from service.storage.times import iso_time as iso_time
from service.storage.times import utcnow as utcnow


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        list[Any]: JSON,
        datetime: DateTime(timezone=True),
    }


# SQLite only auto-increments INTEGER PRIMARY KEY; Postgres gets a 64-bit key.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    project: Mapped[str | None] = mapped_column(String(200))
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)  # model, algorithm, environment, tags
    scorer: Mapped[str] = mapped_column(String(200))
    scorer_mode: Mapped[str] = mapped_column(String(16))  # reference | policy
    score_every: Mapped[int] = mapped_column(Integer, default=1)
    samplers: Mapped[list[Any]] = mapped_column(default=list)
    num_samples: Mapped[int | None] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(Integer, default=0)
    temperature: Mapped[float] = mapped_column(Float, default=1.0)
    filter: Mapped[dict[str, Any]] = mapped_column(default=dict)  # SNR filter settings for the advice
    alert_rules: Mapped[dict[str, Any]] = mapped_column(default=dict)
    reasoning_extraction: Mapped[str] = mapped_column(String(16), default="auto")  # auto | think_tags | whole_response
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # A step below one already scored starts a new segment (a resumed or re-run trainer): the
    # series of the newest segment replace the older ones from its first step on. Steps that
    # arrive out of order before a later one was scored are still scored in step order.
    segment: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    claimed_step: Mapped[int | None] = mapped_column(Integer)  # newest step of the segment taken for scoring
    # The ingest token that created the run (max_runs_per_token counts them); no foreign key: tokens
    # are revoked, never deleted, and SQLite could not add one without rebuilding this table.
    created_by_token: Mapped[int | None] = mapped_column(Integer)
    last_claimed_at: Mapped[datetime | None] = mapped_column()  # workers serve the least recently claimed run first
    # Bytes of the run's stored batch payloads (accepted minus purged): max_stored_bytes_per_run bounds it.
    payload_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    path: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(8))  # full | lora
    step: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Batch(Base):
    """One accepted training step: the payload as sent, and its scoring's status and results."""

    __tablename__ = "batches"
    __table_args__ = (
        UniqueConstraint("run_id", "client_batch_id", name="uq_batches_run_client_id"),
        Index("ix_batches_status_created", "status", "created_at"),
        Index("ix_batches_run_status_step", "run_id", "status", "step"),
        # created_at: a replay's first batch of a step (batch_by_content) read in order from this index, not
        # from ix_batches_run_created along the run's whole history.
        Index("ix_batches_run_step", "run_id", "step", "created_at"),
        # The pace read's newest accepted and newest finished batches (service.reads.pace).
        Index("ix_batches_run_created", "run_id", "created_at"),
        Index("ix_batches_run_status_finished", "run_id", "status", "finished_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    segment: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The client's idempotency key (its column keeps the key's first name).
    idempotency_key: Mapped[str | None] = mapped_column("client_batch_id", String(200))
    kind: Mapped[str] = mapped_column(String(16))  # rollouts | matrix
    payload: Mapped[str] = mapped_column(Text)  # the request body as sent; "" once purged
    payload_sha256: Mapped[str] = mapped_column(String(64))  # kept after a purge: replays are still recognised
    payload_purged_at: Mapped[datetime | None] = mapped_column()  # set by payload retention
    checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"))
    status: Mapped[str] = mapped_column(String(16))  # queued | scoring | done | failed
    error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(100))
    lease_expires_at: Mapped[datetime | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column()
    scoring_seconds: Mapped[float | None] = mapped_column(Float)
    tokens_scored: Mapped[int | None] = mapped_column(BigInteger)
    scorer: Mapped[str | None] = mapped_column(String(200))
    checkpoint: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class MetricPoint(Base):
    """One value of one metric at one step: the time series everything else reads."""

    __tablename__ = "metric_points"
    __table_args__ = (
        UniqueConstraint("batch_id", "sampler", "name", name="uq_metric_points_batch_sampler_name"),
        Index("ix_metric_points_run_name_step", "run_id", "name", "step"),
        # Covering: series reads (charts, sparklines, alert rules) never touch the table itself.
        Index("ix_metric_points_run_sampler_name_step", "run_id", "sampler", "name", "step", "value"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    segment: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    sampler: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(80))
    value: Mapped[float] = mapped_column(Float)
    scorer: Mapped[str | None] = mapped_column(String(200))
    checkpoint: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class LatestMetric(Base):
    """The newest value per (run, sampler, name), read by the Prometheus collector."""

    __tablename__ = "latest_metrics"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    sampler: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(80), primary_key=True)
    step: Mapped[int] = mapped_column(Integer)
    segment: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    value: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class EmaRecord(Base):
    """The marginal-std EMA of each (run, sampler), carried from one scored step to the next."""

    __tablename__ = "ema_states"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    sampler: Mapped[str] = mapped_column(String(32), primary_key=True)
    marginal_std: Mapped[float | None] = mapped_column(Float)
    marginal_std_seq: Mapped[float | None] = mapped_column(Float)
    step: Mapped[int] = mapped_column(Integer)


class Alert(Base):
    """One alert episode of a (run, sampler, rule): pending, then firing, then resolved."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_run_rule_sampler_state", "run_id", "rule", "sampler", "state"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    sampler: Mapped[str] = mapped_column(String(32))
    rule: Mapped[str] = mapped_column(String(40))
    severity: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))  # pending | firing | resolved
    onset_step: Mapped[int] = mapped_column(Integer)
    fired_step: Mapped[int | None] = mapped_column(Integer)
    resolved_step: Mapped[int | None] = mapped_column(Integer)
    last_step: Mapped[int] = mapped_column(Integer)
    value: Mapped[float | None] = mapped_column(Float)
    baseline: Mapped[float | None] = mapped_column(Float)
    threshold: Mapped[float | None] = mapped_column(Float)
    summary: Mapped[str] = mapped_column(Text)
    description: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class AlertCheckpoint(Base):
    """The alert rules' state of one (run, sampler) after its newest evaluated step (``alerts.rules.Replay``).

    The next step's evaluation resumes from it and reads only the points after ``step``, while the
    run stays in ``segment`` under the same rules (``rules_key``); otherwise it replays the whole
    history and writes a new one. The row is locked while a step is evaluated, so evaluations of
    one (run, sampler) take turns; ``state`` is None until the first evaluation.
    """

    __tablename__ = "alert_checkpoints"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    sampler: Mapped[str] = mapped_column(String(32), primary_key=True)
    rules_key: Mapped[str] = mapped_column(String(64), default="")
    segment: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer, default=-1)
    state: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class AlertDelivery(Base):
    """A notification owed to a receiver; retried with backoff until delivered, never dropped."""

    __tablename__ = "alert_deliveries"
    __table_args__ = (Index("ix_alert_deliveries_status_next", "status", "next_attempt_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    alert_id: Mapped[int] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"), index=True)
    receiver: Mapped[str] = mapped_column(String(64))  # webhook | slack | alertmanager
    url: Mapped[str] = mapped_column(Text)
    event: Mapped[str] = mapped_column(String(16))  # firing | resolved
    payload: Mapped[dict[str, Any]] = mapped_column()
    status: Mapped[str] = mapped_column(String(16))  # pending | delivering | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    lease_owner: Mapped[str | None] = mapped_column(String(100))
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column()


class ScorerLimits(Base):
    """What a named scorer can score, recorded by the process that loaded it; ingest checks token ids against it."""

    __tablename__ = "scorer_limits"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    vocab_size: Mapped[int] = mapped_column(Integer)
    max_positions: Mapped[int | None] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class ScorerOutage(Base):
    """A named scorer whose server a worker found not answering, until one finds it answering again: what
    /readyz and /metrics report (any process reads it; the worker's own circuit breaker is in its memory)."""

    __tablename__ = "scorer_outages"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    since: Mapped[datetime] = mapped_column()  # when the worker first found it down
    error: Mapped[str] = mapped_column(Text)  # the last error: the scoring's, then each failed probe's
    checked_at: Mapped[datetime] = mapped_column(default=utcnow)


class ScoreMatrix(Base):
    """The cross-scoring matrix of one scored batch and sampler, as the scorer computed it.

    ``l_tok`` holds L_tok[i, j] = log p(z_i | x_j) per reasoning token (nats), float32
    little-endian, row-major [n_rows, n_columns], rows in the order they were scored.
    """

    __tablename__ = "score_matrices"
    __table_args__ = (Index("ix_score_matrices_run_sampler_step", "run_id", "sampler", "step"),)

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    sampler: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    n_rows: Mapped[int] = mapped_column(Integer)
    n_columns: Mapped[int] = mapped_column(Integer)
    l_tok: Mapped[bytes] = mapped_column(LargeBinary)
    column_of_row: Mapped[list[Any]] = mapped_column()  # [n_rows] each row's own column
    column_labels: Mapped[list[Any]] = mapped_column()  # [n_columns] the prompt group id of each column
    row_sources: Mapped[list[Any] | None] = mapped_column(JSON)  # [n_rows] (trajectory, turn); None for matrices
    # [n_columns] the first reasoning excerpts of each column's rows, cut at scoring time under the
    # run's reasoning_extraction; None for uploaded matrices (no text) and for those stored before 0010.
    excerpts: Mapped[list[Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiToken(Base):
    """A bearer token of the API. Only the SHA-256 of its secret is stored; the secret is shown once."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    scope: Mapped[str] = mapped_column(String(16))  # ingest | read | admin
    run_prefix: Mapped[str] = mapped_column(String(200), default="")  # ingest: the runs it may write ("" any)
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    hint: Mapped[str] = mapped_column(String(16))  # the secret's first characters, to recognise it in a list
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column()


ACCESS_STATE_ID = 1  # access_state holds one row


class AccessState(Base):
    """Facts about access that outlive the tokens: its one row says tokens were issued on this database."""

    __tablename__ = "access_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tokens_issued_at: Mapped[datetime] = mapped_column(default=utcnow)  # when the first token was issued
