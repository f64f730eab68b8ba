"""Prometheus metrics on an explicit registry: service counters, and the diagnostics as gauges.

Diagnostics come from the latest-value table through ``DiagnosticsCollector``, which is handed a
function that reads a ``MetricsSnapshot``; this module never touches the database itself, so any
number of API and worker processes expose the same figures without multiprocess mode.
``EXPORTED`` is the catalogue of exported diagnostics (``docs/metrics.md`` is generated from it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

NAMESPACE = "collapse_monitor"
SCORING_SECONDS_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)  # the histogram's bounds
log = logging.getLogger("collapse_monitor.metrics")
SCORER_UP_HELP = (
    "0 while a worker finds the named scorer's server not answering (its runs' batches wait, then fail after "
    "scorer_outage_seconds), else 1."
)


@dataclass(frozen=True)
class Exported:
    stored: str  # metric name as stored (RAGEN's where it has one)
    name: str  # Prometheus name without the namespace
    help: str


EXPORTED = (
    Exported("mi_estimate", "mi_estimate_nats", "Per-token mutual information estimate I(X;Z) (RAGEN mi_estimate)."),
    Exported(
        "mi_estimate_ci_low", "mi_estimate_ci_low_nats", "Lower bound of the 95% bootstrap interval of mi_estimate."
    ),
    Exported(
        "mi_estimate_ci_high", "mi_estimate_ci_high_nats", "Upper bound of the 95% bootstrap interval of mi_estimate."
    ),
    Exported("mi_seq_estimate", "mi_seq_estimate_nats", "Per-sequence mutual information estimate."),
    Exported("mi_upper_bound", "mi_upper_bound_nats", "ln N, the ceiling of the MI estimate for N scored prompts."),
    Exported("mi_zscore", "mi_zscore", "MI z-score: mean (matched - marginal) / (marginal std + eps)."),
    Exported("mi_zscore_ema", "mi_zscore_ema", "MI z-score normalized by the EMA of the marginal std."),
    Exported("marginal_std_ema", "marginal_std_ema_nats", "EMA of the std of the marginal log-probabilities."),
    Exported("conditional_entropy_est", "conditional_entropy_nats", "Per-token H(Z|X): within-input diversity."),
    Exported("reasoning_entropy_est", "reasoning_entropy_nats", "Per-token H(Z): reasoning diversity across inputs."),
    Exported("conditional_entropy_seq_est", "conditional_entropy_seq_nats", "Per-sequence H(Z|X)."),
    Exported("reasoning_entropy_seq_est", "reasoning_entropy_seq_nats", "Per-sequence H(Z)."),
    Exported(
        "retrieval_accuracy", "retrieval_accuracy_ratio", "Share of reasoning rows whose own prompt scores highest."
    ),
    Exported("retrieval_chance_level", "retrieval_chance_ratio", "Retrieval accuracy expected by chance."),
    Exported("retrieval_above_chance", "retrieval_above_chance_ratio", "Retrieval accuracy minus chance."),
    Exported("token_entropy_mean", "token_entropy_nats", "Mean next-token entropy over matched reasoning tokens."),
    Exported(
        "mi_head_estimate",
        "mi_head_estimate_nats",
        "Per-token MI over each reasoning's first head_tokens tokens: appended text cannot move it.",
    ),
    Exported(
        "conditional_entropy_head_est", "conditional_entropy_head_nats", "Per-token H(Z|X) over the same head tokens."
    ),
    Exported("mi_excess", "mi_excess_nats", "Per-token MI minus its permutation-null mean (does not saturate)."),
    Exported("mi_head_excess", "mi_head_excess_nats", "mi_excess over each reasoning's first head_tokens tokens."),
    Exported("mi_seq_normalized", "mi_seq_normalized_ratio", "Per-sequence MI as a share of its ceiling ln N."),
    Exported(
        "retrieval_chance_corrected",
        "retrieval_chance_corrected_ratio",
        "(retrieval accuracy - chance) / (1 - chance): 0 at chance, 1 when every row finds its prompt.",
    ),
    Exported("retrieval_mrr", "retrieval_mrr_ratio", "Mean reciprocal rank of each row's own prompt."),
    Exported(
        "nearest_log_ratio",
        "nearest_log_ratio_nats",
        "Sequence log-ratio of each reasoning's own prompt over its 3 most similar other prompts (uncapped).",
    ),
    Exported(
        "mi_permutation_p",
        "mi_permutation_pvalue_ratio",
        "Permutation p-value of the matched log-probs: how likely this much input dependence is with none.",
    ),
    Exported(
        "duplicate_row_ratio", "duplicate_rows_ratio", "Share of rows whose reasoning repeats a row of another prompt."
    ),
    Exported(
        "distinct_prompts",
        "distinct_prompts",
        "Distinct prompts among the scored columns (P): retrieval's chance is 1/P; TemplateCollapse does not judge "
        "a step of fewer than min_prompts.",
    ),
    Exported("rows", "scored_rows", "Reasoning rows scored at the last scored step."),
    Exported("columns", "scored_columns", "Prompts (columns) scored at the last scored step."),
    Exported("rollout/in_group_reward_std", "reward_std", "Mean over prompt groups of the in-group reward std (n-1)."),
    Exported("reward_mean", "reward_mean", "Mean trajectory reward."),
    Exported(
        "zero_variance_group_ratio", "zero_variance_groups_ratio", "Share of prompt groups whose rewards do not vary."
    ),
    Exported("rollout/filter_zero_count", "filter_zero_groups", "Groups scoring 0 under the SNR filter's metric."),
    Exported(
        "rollout/filter_kept_ratio",
        "filter_kept_ratio",
        "Share of prompt groups the SNR-aware filter keeps: the run's filter's advice (sampler all), or what the "
        "trainer's own filter kept (sampler trainer).",
    ),
    Exported("rollout/filter_kept_rows", "filter_kept_rows", "Rows the trainer's SNR filter kept (sampler trainer)."),
    Exported(
        "rollout/filter_engaged",
        "filter_engaged",
        "1 when the trainer's SNR filter acted on the step (sampler trainer).",
    ),
    Exported(
        "rollout/filter_skipped",
        "filter_skipped",
        "1 when the trainer's SNR filter kept no group, so the trainer skipped the optimizer step (sampler trainer).",
    ),
    Exported(
        "rollout/chosen_in_group_reward_std",
        "filter_kept_reward_std",
        "Mean in-group reward std of the groups the SNR filter keeps (sampler all: advice; trainer: kept).",
    ),
    Exported(
        "rollout/dropped_in_group_reward_std",
        "filter_dropped_reward_std",
        "Mean in-group reward std of the groups the trainer's SNR filter dropped (sampler trainer).",
    ),
    Exported("valid_thinking_rate", "valid_thinking_ratio", "Share of turns carrying non-empty reasoning."),
    Exported(
        "truncated_think_ratio",
        "truncated_think_ratio",
        "Share of turns whose think block was opened and never closed (cut by the length limit).",
    ),
    Exported(
        "truncated_reasoning_ratio",
        "truncated_reasoning_ratio",
        "Share of the scored rows whose reasoning was cut to the reasoning window (max_reasoning_tokens).",
    ),
    Exported(
        "planned_rows_ratio",
        "planned_rows_ratio",
        "Share of the sampled rows the step's scoring budget let the worker score (1: every row; see plan).",
    ),
    Exported(
        "missing_reward_ratio", "missing_reward_ratio", "Share of trajectories sent with a null (missing) reward."
    ),
    Exported(
        "trainer_token_entropy_mean", "trainer_token_entropy_nats", "Mean of the token entropies the trainer sent."
    ),
    Exported(
        "trainer_scorer_logprob_gap",
        "trainer_scorer_logprob_gap_nats",
        "Mean |trainer - scorer| log-probability per reasoning token on matched pairs, over the tokens scored "
        "(turns that sent reasoning_logprobs).",
    ),
    Exported(
        "actor/entropy",
        "policy_token_entropy_nats",
        "The policy's mean token entropy over its own completions, as the trainer computed it (sampler trainer).",
    ),
)


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the collector exports, read from the database at scrape time."""

    latest: list[tuple[str, str, str, float, int]]  # run, sampler, name, value, step; recent runs first
    batches: dict[str, int]  # status -> count
    scoring: dict[str, Any]  # storage.queue.scoring_stats()
    buckets: tuple[float, ...] = field(default=())
    alerts: list[tuple[str, str, str, str, str]] = field(default_factory=list)  # run, sampler, rule, severity, state
    deliveries: list[tuple[str, str, int]] = field(default_factory=list)  # receiver, status, count
    scorers: tuple[str, ...] = ()  # the named scorers configured
    scorers_down: tuple[str, ...] = ()  # those a worker last found not answering (storage.scorer_outages)


class ServiceMetrics:
    """The in-process counters of one API process; every known rejection reason is exported from 0."""

    def __init__(self, registry: CollectorRegistry, rejection_reasons: Iterable[str] = ()) -> None:
        self.requests = Counter(
            "requests",
            "HTTP requests answered, by method, route template and status code.",
            ["method", "route", "status"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.rejections = Counter(
            "rejections",
            "Requests refused, by reason (validation, invalid_request, not_found, too_large, queue_full, ...).",
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for reason in rejection_reasons:
            self.rejections.labels(reason)
        self.segments_started = Counter(
            "segments_started",
            "Batches whose step went back below one the run had taken and started a segment (a resume, or two "
            "uploaders racing), by stream (rollouts, matrix).",
            ["stream"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for stream in ("rollouts", "matrix"):
            self.segments_started.labels(stream)


class SnapshotCache:
    """``read()`` at most once per ``seconds``: scrapes in between get the snapshot read last.

    ``/metrics`` is open (and not rate-limited) by default, and a snapshot runs aggregates over
    whole tables; Prometheus scrapes every 15 s, so a few seconds' cache costs it nothing while any
    number of scrapers cost the database one read per period. Concurrent scrapes wait for one
    read rather than each making its own. A failed read is not kept: the next scrape tries again.
    ``seconds`` 0 reads at every scrape.
    """

    def __init__(
        self, read: Callable[[], MetricsSnapshot], seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.read, self.seconds, self.clock = read, seconds, clock
        self._lock = threading.Lock()
        self._kept: tuple[float, MetricsSnapshot] | None = None
        self.reads = 0

    def __call__(self) -> MetricsSnapshot:
        with self._lock:
            if self._kept is not None and self.clock() - self._kept[0] < self.seconds:
                return self._kept[1]
            snapshot = self.read()
            self.reads += 1
            self._kept = (self.clock(), snapshot)
            return snapshot


class DiagnosticsCollector(Collector):
    """The diagnostics of every run, at most ``max_series`` of them (whole runs, the most recently updated first).

    A scrape that cannot read the database answers ``database_up 0``. A run of failed scrapes (an
    outage) is logged twice, when it starts and when the database answers again: ``outage(error)``
    gives the one line to log for an error that means the database is away, None for anything
    else, which is logged with its traceback (once per run of failures too).
    """

    def __init__(
        self,
        read: Callable[[], MetricsSnapshot],
        max_series: int = 20_000,
        outage: Callable[[BaseException], str | None] = lambda _: None,
    ) -> None:
        self.read = read
        self.max_series = max_series
        self.outage = outage
        self._failed_since: float | None = None  # monotonic time of the first failed scrape of a run of them
        self._failures = 0
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        return []  # collected on demand; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{NAMESPACE}_database_up", "1 when the last scrape could read the database.")
        try:
            snapshot = self.read()
        except Exception as e:
            self._failed(e)
            up.add_metric([], 0.0)
            yield up
            return
        self._answered()
        up.add_metric([], 1.0)
        yield up
        yield from _diagnostics(snapshot, self.max_series)
        yield from _service(snapshot)
        yield from _alerts(snapshot)

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            self._failures += 1
            if self._failed_since is not None:
                return
            self._failed_since = time.monotonic()
        line = self.outage(error)
        if line is None:
            log.exception("reading metrics from the database failed; /metrics answers database_up 0")
        else:
            log.warning("reading metrics: %s; /metrics answers database_up 0 until it answers again", line)

    def _answered(self) -> None:
        with self._lock:
            since, failures = self._failed_since, self._failures
            self._failed_since, self._failures = None, 0
        if since is not None:
            log.info(
                "reading metrics: the database answers again after %d failed scrapes in %.1f s",
                failures,
                time.monotonic() - since,
            )


def _diagnostics(snapshot: MetricsSnapshot, max_series: int) -> Iterator[Metric]:
    by_name: dict[str, list[tuple[str, str, float]]] = {}
    last_step: dict[str, int] = {}
    kept, dropped = _within(snapshot.latest, max_series)
    for run, sampler, name, value, step in kept:
        by_name.setdefault(name, []).append((run, sampler, value))
        last_step[run] = max(step, last_step.get(run, step))
    for exported in EXPORTED:
        family = GaugeMetricFamily(f"{NAMESPACE}_{exported.name}", exported.help, labels=["run", "sampler"])
        for run, sampler, value in by_name.get(exported.stored, []):
            family.add_metric([run, sampler], value)
        yield family
    newest = GaugeMetricFamily(f"{NAMESPACE}_last_step", "Newest training step with stored figures.", labels=["run"])
    for run, value in sorted(last_step.items()):
        newest.add_metric([run], float(value))
    yield newest
    left_out = GaugeMetricFamily(
        f"{NAMESPACE}_series_dropped",
        "Diagnostic series left out of this scrape by max_exported_series (the least recently updated runs).",
    )
    left_out.add_metric([], float(dropped))
    yield left_out


Row = tuple[str, str, str, float, int]


def _within(latest: list[Row], max_series: int) -> tuple[list[Row], int]:
    """Whole runs, in the order given (most recently updated first), while their series fit ``max_series``."""
    stored = {e.stored for e in EXPORTED}
    by_run: dict[str, list[Row]] = {}
    for row in latest:
        by_run.setdefault(row[0], []).append(row)
    kept: list[Row] = []
    used = dropped = 0
    for rows in by_run.values():
        series = 1 + sum(1 for row in rows if row[2] in stored)  # its gauges and its last_step
        if used + series > max_series:
            dropped += series
            continue
        used += series
        kept.extend(rows)
    return kept, dropped


def _service(snapshot: MetricsSnapshot) -> Iterator[Metric]:
    queue = GaugeMetricFamily(f"{NAMESPACE}_queue_depth", "Batches accepted and waiting to be scored.")
    queue.add_metric([], float(snapshot.batches.get("queued", 0)))
    yield queue
    scoring_now = GaugeMetricFamily(f"{NAMESPACE}_batches_in_progress", "Batches being scored right now.")
    scoring_now.add_metric([], float(snapshot.batches.get("scoring", 0)))
    yield scoring_now
    finished = CounterMetricFamily(
        f"{NAMESPACE}_batches_scored", "Batches whose scoring finished, by outcome (done, failed).", labels=["status"]
    )
    for status in ("done", "failed"):
        finished.add_metric([status], float(snapshot.batches.get(status, 0)))
    yield finished
    stats = snapshot.scoring
    histogram = HistogramMetricFamily(
        f"{NAMESPACE}_scoring_duration_seconds", "Wall time to score one batch (all its samplers)."
    )
    cumulative = [(str(bound), float(n)) for bound, n in zip(snapshot.buckets, stats["buckets"], strict=True)]
    histogram.add_metric([], [*cumulative, ("+Inf", float(stats["count"]))], sum_value=stats["sum_seconds"])
    yield histogram
    tokens = CounterMetricFamily(f"{NAMESPACE}_scored_tokens", "Tokens run through scorer models.")
    tokens.add_metric([], float(stats["tokens"]))
    yield tokens
    speed = GaugeMetricFamily(
        f"{NAMESPACE}_scorer_tokens_per_second", "Scorer throughput over the last 20 scored batches."
    )
    if stats["recent_tokens_per_second"] is not None:
        speed.add_metric([], float(stats["recent_tokens_per_second"]))
    yield speed
    up = GaugeMetricFamily(f"{NAMESPACE}_scorer_up", SCORER_UP_HELP, labels=["scorer"])
    for name in sorted({*snapshot.scorers, *snapshot.scorers_down}):
        up.add_metric([name], 0.0 if name in snapshot.scorers_down else 1.0)
    yield up


def _alerts(snapshot: MetricsSnapshot) -> Iterator[Metric]:
    active = GaugeMetricFamily(
        f"{NAMESPACE}_alerts",
        "Pending and firing alerts (1 each), by run, sampler, rule, severity and state.",
        labels=["run", "sampler", "rule", "severity", "state"],
    )
    for labels in sorted(snapshot.alerts):
        active.add_metric(list(labels), 1.0)
    yield active
    deliveries = GaugeMetricFamily(
        f"{NAMESPACE}_alert_deliveries",
        "Alert notifications by receiver and status (pending, delivering, delivered, failed).",
        labels=["receiver", "status"],
    )
    for receiver, status, n in sorted(snapshot.deliveries):
        deliveries.add_metric([receiver, status], float(n))
    yield deliveries


def catalogue_markdown() -> str:
    """docs/metrics.md: every exported diagnostic, generated from ``EXPORTED``."""
    lines = [
        "# Metric catalogue",
        "",
        "Generated from `service/metrics.py` (`EXPORTED`):",
        "`.venv/bin/python -m service.metrics > docs/metrics.md` regenerates it.",
        "",
        "Diagnostics are gauges labelled `run` and `sampler` (`first_turn`, `trajectory`, a matrix sampler,",
        "`all` for batch-level reward and coverage figures, or `trainer` for figures the trainer computed and sent),",
        "holding the newest stored value.",
        "",
        "| Prometheus name | stored name (`/v1/runs/{run}/metrics`) | meaning |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{NAMESPACE}_{e.name}` | `{e.stored}` | {e.help} |" for e in EXPORTED]
    lines += [
        "",
        "Service metrics:",
        "",
        "| Prometheus name | type | meaning |",
        "| --- | --- | --- |",
        f"| `{NAMESPACE}_last_step` | gauge (`run`) | Newest training step with stored figures. |",
        f"| `{NAMESPACE}_queue_depth` | gauge | Batches accepted and waiting to be scored. |",
        f"| `{NAMESPACE}_batches_in_progress` | gauge | Batches being scored right now. |",
        f"| `{NAMESPACE}_batches_scored_total` | counter (`status`) | Finished batches: done or failed. |",
        f"| `{NAMESPACE}_scoring_duration_seconds` | histogram | Wall time to score one batch. |",
        f"| `{NAMESPACE}_scored_tokens_total` | counter | Tokens run through scorer models. |",
        f"| `{NAMESPACE}_scorer_tokens_per_second` | gauge | Scorer throughput over the last 20 scored batches. |",
        f"| `{NAMESPACE}_scorer_up` | gauge (`scorer`) | {SCORER_UP_HELP} |",
        f"| `{NAMESPACE}_requests_total` | counter (`method`, `route`, `status`) | HTTP requests of this process. |",
        f"| `{NAMESPACE}_rejections_total` | counter (`reason`) | Requests refused, by reason. |",
        f"| `{NAMESPACE}_segments_started_total` | counter (`stream`) | Batches (`rollouts`, `matrix`) whose step went "
        "back and started a segment: a resume, or two uploaders racing. |",
        f"| `{NAMESPACE}_database_up` | gauge | 1 when the last scrape could read the database. |",
        f"| `{NAMESPACE}_series_dropped` | gauge | Diagnostic series left out by `max_exported_series`. |",
        f"| `{NAMESPACE}_alerts` | gauge (`run`, `sampler`, `rule`, `severity`, `state`) | 1 per active alert. |",
        f"| `{NAMESPACE}_alert_deliveries` | gauge (`receiver`, `status`) | Alert notifications by status. |",
        "",
        "Every stored name (all RAGEN metrics, intervals, coverage, `rollout/...` filter figures and every figure a",
        "trainer sent) is queryable through `GET /v1/runs/{run}/metrics`; Prometheus carries the ones above.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(catalogue_markdown())
