"""Builds the Grafana dashboards in dashboards/grafana/ with grafana-foundation-sdk.

    .venv/bin/python dashboards/build.py          # (re)writes run.json and fleet.json
    .venv/bin/python dashboards/build.py --check  # exits 1 when the committed JSON is stale

A build-time tool: the service never imports it, and the JSON it writes is committed. Two data
sources, both provisioned by dashboards/provisioning/datasources.yml under fixed uids:

- Prometheus (scraping the service's /metrics) for current values and wall-clock time series;
- the service's PostgreSQL database for the history by training step (metric_points) and the
  alert episodes (alerts). Those panels put the step, not time, on the x axis.

No collapse thresholds are drawn here: they belong to the alert rules, and the alerts table
carries each episode's threshold. Only "firing alerts > 0" is coloured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, table, timeseries, trend
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as models

OUT_DIR = Path(__file__).resolve().parent / "grafana"
PROMETHEUS = models.DataSourceRef(type_val="prometheus", uid="collapse-prometheus")
# The core PostgreSQL plugin's id since Grafana 10.2.3 ("postgres" remains an alias).
POSTGRES = models.DataSourceRef(type_val="grafana-postgresql-datasource", uid="collapse-postgres")
RUN_UID = "collapse-monitor-run"
FLEET_UID = "collapse-monitor-fleet"
TAGS = ["collapse-monitor"]

NATS = "suffix: nats"
RATIO = "percentunit"
NUMBER = "none"
# SQL for the sampler picked in the dashboard: Grafana quotes the value and escapes its quotes.
SELECTED_SAMPLER = "${sampler:sqlstring}"

Panel = stat.Panel | trend.Panel | timeseries.Panel | table.Panel
Overrides = list[tuple[str, list[models.DynamicConfigValue]]]  # field name -> properties


# Queries -----------------------------------------------------------------------------------------


class SqlQuery(cogvariants.Dataquery):
    """A raw-SQL target of the PostgreSQL data source.

    grafana-foundation-sdk 10.1 has builders for Prometheus but none for the SQL data sources, so
    this target is written here through the SDK's extension point (a ``Dataquery`` variant).
    """

    def __init__(self, sql: str, ref_id: str) -> None:
        self.sql = sql
        self.ref_id = ref_id

    def to_json(self) -> dict[str, object]:
        return {
            "refId": self.ref_id,
            "datasource": POSTGRES,
            "editorMode": "code",
            "format": "table",
            "rawQuery": True,
            "rawSql": self.sql,
        }


class Sql(cogbuilder.Builder[cogvariants.Dataquery]):
    def __init__(self, sql: str, ref_id: str = "A") -> None:
        self._query = SqlQuery(sql, ref_id)

    def build(self) -> cogvariants.Dataquery:
        return self._query


def promql(expr: str, legend: str, ref_id: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).datasource(PROMETHEUS).range()


def step_sql(columns: dict[str, str], sampler: str) -> str:
    """One row per training step of the selected run, one column per stored metric name.

    ``columns`` maps column label -> stored name. Several batches may carry the same step (a step
    resent under a new batch id); the panel draws their mean.
    """
    picks = ",\n".join(
        f"  avg(mp.value) FILTER (WHERE mp.name = '{name}') AS \"{label}\"" for label, name in columns.items()
    )
    names = ", ".join(f"'{name}'" for name in columns.values())
    return (
        'SELECT mp.step AS "step",\n'
        f"{picks}\n"
        "FROM metric_points mp\n"
        "JOIN runs r ON r.id = mp.run_id\n"
        "WHERE r.name = ${run:sqlstring}\n"
        f"  AND mp.sampler = {sampler}\n"
        f"  AND mp.name IN ({names})\n"
        "  AND $__timeFilter(mp.created_at)\n"
        "GROUP BY mp.step\n"
        "ORDER BY mp.step"
    )


def gauge(metric: str, sampler: str = "$sampler") -> str:
    """The newest value of one per-run gauge. Every API process exports the same database-backed
    figures, so `max` folds the copies scraped from several processes into one series."""
    return f'max(collapse_monitor_{metric}{{run="$run", sampler="{sampler}"}})'


# Panels ------------------------------------------------------------------------------------------


def legend() -> common.VizLegendOptions:
    return (
        common.VizLegendOptions()
        .show_legend(True)
        .display_mode(common_models.LegendDisplayMode.LIST)
        .placement(common_models.LegendPlacement.BOTTOM)
    )


def tooltip() -> common.VizTooltipOptions:
    return common.VizTooltipOptions().mode(common_models.TooltipDisplayMode.MULTI).sort(common_models.SortOrder.NONE)


def neutral() -> dashboard.ThresholdsConfig:
    """One colour for every value: a collapse threshold lives in the alert rules, not here."""
    return (
        dashboard.ThresholdsConfig()
        .mode(models.ThresholdsMode.ABSOLUTE)
        .steps([models.Threshold(value=None, color="text")])
    )


def red_from(value: float) -> dashboard.ThresholdsConfig:
    return (
        dashboard.ThresholdsConfig()
        .mode(models.ThresholdsMode.ABSOLUTE)
        .steps([models.Threshold(value=None, color="green"), models.Threshold(value=value, color="red")])
    )


def band(high: str, low: str) -> Overrides:
    """Overrides that shade the area between two series (an interval) and hide their lines."""
    return [
        (
            high,
            [
                models.DynamicConfigValue("custom.fillBelowTo", low),
                models.DynamicConfigValue("custom.fillOpacity", 20),
                models.DynamicConfigValue("custom.lineWidth", 0),
            ],
        ),
        (low, [models.DynamicConfigValue("custom.lineWidth", 0)]),
    ]


def dashed(name: str) -> tuple[str, list[models.DynamicConfigValue]]:
    return (name, [models.DynamicConfigValue("custom.lineStyle", {"fill": "dash", "dash": [10, 10]})])


def right_axis(name: str, unit: str) -> tuple[str, list[models.DynamicConfigValue]]:
    return (
        name,
        [models.DynamicConfigValue("unit", unit), models.DynamicConfigValue("custom.axisPlacement", "right")],
    )


def by_step(
    title: str,
    description: str,
    columns: dict[str, str],
    unit: str,
    sampler: str = SELECTED_SAMPLER,
    overrides: Overrides | None = None,
    span: int = 12,
) -> trend.Panel:
    """A trend panel over training steps from metric_points (Postgres): x is the `step` column."""
    panel = (
        trend.Panel()
        .title(title)
        .description(description)
        .datasource(POSTGRES)
        .with_target(Sql(step_sql(columns, sampler)))
        .x_field("step")
        .unit(unit)
        .line_width(2)
        .show_points(common_models.VisibilityMode.AUTO)
        .span_nulls(True)
        .legend(legend())
        .tooltip(tooltip())
        .height(8)
        .span(span)
    )
    for name, properties in overrides or []:
        panel.override_by_name(name, properties)
    return panel


def over_time(
    title: str, description: str, targets: list[prometheus.Dataquery], unit: str, overrides: Overrides | None = None
) -> timeseries.Panel:
    """A time-series panel from Prometheus: wall-clock time on x; alert annotations show here."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(PROMETHEUS)
        .targets(targets)
        .unit(unit)
        .line_width(2)
        .span_nulls(True)
        .legend(legend())
        .tooltip(tooltip())
        .height(8)
        .span(12)
    )
    for name, properties in overrides or []:
        panel.override_by_name(name, properties)
    return panel


def current(title: str, description: str, expr: str, unit: str, span: int = 3) -> stat.Panel:
    """A stat panel: the newest value, with its recent history as a sparkline."""
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(PROMETHEUS)
        .with_target(promql(expr, title))
        .unit(unit)
        .thresholds(neutral())
        .color_mode(common_models.BigValueColorMode.VALUE)
        .graph_mode(common_models.BigValueGraphMode.AREA)
        .text_mode(common_models.BigValueTextMode.VALUE)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .height(4)
        .span(span)
    )


def sql_table(title: str, description: str, sql: str, overrides: Overrides, height: int = 8) -> table.Panel:
    panel = (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(POSTGRES)
        .with_target(Sql(sql))
        .unit(NUMBER)
        .thresholds(neutral())
        .height(height)
        .span(24)
    )
    for name, properties in overrides:
        panel.override_by_name(name, properties)
    return panel


ALERT_STATE_COLOURS = [
    models.DynamicConfigValue(
        "mappings",
        [
            {
                "type": "value",
                "options": {
                    "firing": {"color": "red", "index": 0},
                    "pending": {"color": "orange", "index": 1},
                    "resolved": {"color": "green", "index": 2},
                },
            }
        ],
    ),
    models.DynamicConfigValue("custom.cellOptions", {"type": "color-text"}),
]


def assemble(board: dashboard.Dashboard, items: list[dashboard.Row | Panel]) -> dict[str, Any]:
    """Numbers panels and rows 1..n in order and lays them out left to right, top to bottom.

    Positions are computed here because the SDK's layout does not wrap a panel wider than what
    is left of its line. Rows stay open and hold no panels of their own: Grafana nests panels in
    a row only while it is collapsed.
    """
    x = y = line_height = 0
    for panel_id, item in enumerate(items, start=1):
        if isinstance(item, dashboard.Row):
            y, x, line_height = y + line_height, 0, 0
            board.with_row(item.id(panel_id).grid_pos(models.GridPos(h=1, w=24, x=0, y=y)))
            y += 1
            continue
        box = item.build().grid_pos  # its size, from .height() and .span()
        assert box is not None
        if x + box.w > 24:
            y, x, line_height = y + line_height, 0, 0
        box.x, box.y = x, y
        x, line_height = x + box.w, max(line_height, box.h)
        board.with_panel(item.id(panel_id))
    encoded: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return encoded


def base(uid: str, title: str, description: str, time_from: str) -> dashboard.Dashboard:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .editable()
        .tooltip(models.DashboardCursorSync.CROSSHAIR)
        .time(time_from, "now")
        .refresh("1m")
        .link(
            dashboard.DashboardLink("collapse-monitor")
            .type(models.DashboardLinkType.DASHBOARDS)
            .tags(TAGS)
            .as_dropdown(False)
            .include_vars(False)
            .keep_time(True)
        )
    )


# The per-run dashboard ---------------------------------------------------------------------------


def alert_annotation(state: str, colour: str) -> dict[str, Any]:
    """Alert episodes of the run in one state, drawn as regions on the time-series panels.

    An episode opens (created_at) when its rule first trips (pending) and ends when it resolves
    (updated_at); a firing one is drawn up to now. Plain dict: the SDK's AnnotationQuery (10.1)
    only models the built-in Grafana annotation target, not a SQL one.
    """
    end = "now()" if state == "firing" else "a.updated_at"
    sql = (
        'SELECT a.created_at AS "time",\n'
        f'  {end} AS "timeend",\n'
        "  a.summary || ' (' || a.rule || ', ' || a.sampler || ', onset step ' || a.onset_step || ')' AS \"text\",\n"
        "  concat_ws(',', a.state, a.severity, a.rule, a.sampler) AS \"tags\"\n"
        "FROM alerts a\n"
        "JOIN runs r ON r.id = a.run_id\n"
        "WHERE r.name = ${run:sqlstring}\n"
        f"  AND a.state = '{state}'\n"
        "  AND a.fired_step IS NOT NULL\n"
        "  AND a.created_at <= $__timeTo()\n"
        f"  AND {end} >= $__timeFrom()\n"
        "ORDER BY a.created_at"
    )
    return {
        "name": f"Alerts {state}",
        "datasource": POSTGRES.to_json(),
        "enable": True,
        "hide": False,
        "iconColor": colour,
        "target": {"refId": "Anno", "editorMode": "code", "format": "table", "rawQuery": True, "rawSql": sql},
    }


def run_dashboard() -> dict[str, Any]:
    board = base(
        RUN_UID,
        "collapse-monitor: run",
        "One training run: RAGEN-2 collapse diagnostics by training step (PostgreSQL) and over time (Prometheus).",
        "now-7d",
    )
    board.with_variable(
        dashboard.QueryVariable("run")
        .label("Run")
        .description("Runs known to the service, newest first.")
        .datasource(POSTGRES)
        .query("SELECT name FROM runs ORDER BY created_at DESC, id DESC")
        .refresh(models.VariableRefresh.ON_DASHBOARD_LOAD)
        .sort(models.VariableSort.DISABLED)
    )
    board.with_variable(
        dashboard.QueryVariable("sampler")
        .label("Sampler")
        .description("Diagnostic series of the run: first_turn, trajectory, or a matrix sampler.")
        .datasource(PROMETHEUS)
        .query('label_values(collapse_monitor_mi_zscore_ema{run="$run"}, sampler)')
        .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(models.VariableSort.ALPHABETICAL_ASC)
    )
    items: list[dashboard.Row | Panel] = [
        dashboard.Row("Current status: $run ($sampler)"),
        current(
            "Last step",
            "Newest training step with stored figures.",
            'max(collapse_monitor_last_step{run="$run"})',
            NUMBER,
        ),
        current(
            "MI z-score (EMA)",
            "Matched minus marginal log-probability over the EMA of the marginal std; falls toward 0 as "
            "reasoning stops depending on the input (template collapse).",
            gauge("mi_zscore_ema"),
            NUMBER,
        ),
        current("MI estimate", "Per-token I(X;Z) estimate (RAGEN mi_estimate), nats.", gauge("mi_estimate_nats"), NATS),
        current(
            "Retrieval above chance",
            "Share of reasoning rows whose own prompt scores highest, minus the chance level.",
            gauge("retrieval_above_chance_ratio"),
            RATIO,
        ),
        current(
            "Token entropy",
            "Mean next-token entropy over matched reasoning tokens.",
            gauge("token_entropy_nats"),
            NATS,
        ),
        current(
            "Reward std",
            "Mean over prompt groups of the in-group reward std (batch level).",
            gauge("reward_std", "all"),
            NUMBER,
        ),
        current(
            "Zero-variance groups",
            "Share of prompt groups whose rewards do not vary: they carry no GRPO signal.",
            gauge("zero_variance_groups_ratio", "all"),
            RATIO,
        ),
        current(
            "Filter kept ratio",
            "Share of groups the run's SNR-aware filter would keep.",
            gauge("filter_kept_ratio", "all"),
            RATIO,
        ),
        dashboard.Row("By training step: $run ($sampler)"),
        by_step(
            "MI estimate, 95% interval and ln N",
            "Per-token I(X;Z) with its bootstrap interval (shaded), under its ceiling ln N for N scored prompts.",
            {
                "MI estimate": "mi_estimate",
                "95% CI low": "mi_estimate_ci_low",
                "95% CI high": "mi_estimate_ci_high",
                "ln N": "mi_upper_bound",
            },
            NATS,
            overrides=[*band("95% CI high", "95% CI low"), dashed("ln N")],
        ),
        by_step(
            "MI z-score",
            "The z-score normalized by the EMA of the marginal std (what the alert rules read), and per step.",
            {"MI z-score (EMA)": "mi_zscore_ema", "MI z-score": "mi_zscore"},
            NUMBER,
            overrides=[dashed("MI z-score")],
        ),
        by_step(
            "Retrieval accuracy against chance",
            "Share of reasoning rows whose own prompt scores highest among the batch's prompts, and the "
            "accuracy expected by chance: the gap closes as reasoning stops identifying its input.",
            {"retrieval accuracy": "retrieval_accuracy", "chance level": "retrieval_chance_level"},
            RATIO,
            overrides=[dashed("chance level")],
        ),
        by_step(
            "Conditional entropy H(Z|X) and reasoning entropy H(Z)",
            "Per-token entropies: under template collapse H(Z) stays flat while the gap H(Z) - H(Z|X) "
            "(the MI) shrinks, so entropy alone does not reveal it.",
            {"H(Z|X) conditional": "conditional_entropy_est", "H(Z) reasoning": "reasoning_entropy_est"},
            NATS,
        ),
        by_step(
            "Reward std and zero-variance groups",
            "Batch-level reward figures: mean in-group reward std (left) and the share of prompt groups "
            "whose rewards do not vary (right).",
            {"reward std": "rollout/in_group_reward_std", "zero-variance groups": "zero_variance_group_ratio"},
            NUMBER,
            sampler="'all'",
            overrides=[right_axis("zero-variance groups", RATIO)],
        ),
        by_step(
            "Filter kept ratio",
            "Share of prompt groups the run's SNR-aware filter would keep.",
            {"kept ratio": "rollout/filter_kept_ratio"},
            RATIO,
            sampler="'all'",
        ),
        by_step(
            "Token entropy",
            "Mean next-token entropy over matched reasoning tokens, as the scorer sees them.",
            {"token entropy": "token_entropy_mean"},
            NATS,
            span=24,
        ),
        sql_table(
            "Alert episodes",
            "Every alert episode of the run, newest first: when its rule tripped (onset), fired and resolved.",
            'SELECT a.sampler AS "sampler", a.rule AS "rule", a.severity AS "severity", a.state AS "state",\n'
            '  a.onset_step AS "onset step", a.fired_step AS "fired step", a.resolved_step AS "resolved step",\n'
            '  a.value AS "value", a.baseline AS "baseline", a.threshold AS "threshold",\n'
            '  a.summary AS "summary", a.updated_at AS "updated"\n'
            "FROM alerts a\n"
            "JOIN runs r ON r.id = a.run_id\n"
            "WHERE r.name = ${run:sqlstring}\n"
            "ORDER BY a.onset_step DESC, a.id DESC\n"
            "LIMIT 200",
            [("state", ALERT_STATE_COLOURS)],
        ),
        dashboard.Row("Over time: $run"),
        over_time(
            "MI estimate over time",
            "Newest MI estimate of the selected sampler with its 95% interval (shaded) and ln N, as scraped.",
            [
                promql(gauge("mi_estimate_nats"), "MI estimate", "A"),
                promql(gauge("mi_estimate_ci_low_nats"), "95% CI low", "B"),
                promql(gauge("mi_estimate_ci_high_nats"), "95% CI high", "C"),
                promql(gauge("mi_upper_bound_nats"), "ln N", "D"),
            ],
            NATS,
            [*band("95% CI high", "95% CI low"), dashed("ln N")],
        ),
        over_time(
            "MI z-score (EMA) over time, every sampler",
            "The collapse signal of every sampler of the run; alert episodes are drawn as regions.",
            [promql('max by (sampler) (collapse_monitor_mi_zscore_ema{run="$run"})', "{{sampler}}")],
            NUMBER,
        ),
        over_time(
            "Retrieval accuracy against chance over time",
            "Retrieval accuracy and its chance level for the selected sampler.",
            [
                promql(gauge("retrieval_accuracy_ratio"), "retrieval accuracy", "A"),
                promql(gauge("retrieval_chance_ratio"), "chance level", "B"),
            ],
            RATIO,
            [dashed("chance level")],
        ),
        over_time(
            "Entropies over time",
            "H(Z|X) and H(Z) for the selected sampler.",
            [
                promql(gauge("conditional_entropy_nats"), "H(Z|X) conditional", "A"),
                promql(gauge("reasoning_entropy_nats"), "H(Z) reasoning", "B"),
            ],
            NATS,
        ),
    ]
    encoded = assemble(board, items)
    encoded["annotations"] = {"list": [alert_annotation("firing", "red"), alert_annotation("resolved", "green")]}
    return encoded


# The fleet dashboard -----------------------------------------------------------------------------

ACTIVE_RUNS_SQL = """WITH active AS (
  -- a run is active when it stored figures within the dashboard's time range
  SELECT run_id, max(step) AS last_step, max(updated_at) AS updated_at
  FROM latest_metrics
  GROUP BY run_id
  HAVING max(updated_at) >= $__timeFrom()
),
diagnostics AS (
  SELECT run_id, sampler,
    max(value) FILTER (WHERE name = 'mi_zscore_ema') AS mi_zscore_ema,
    max(value) FILTER (WHERE name = 'retrieval_above_chance') AS retrieval_above_chance
  FROM latest_metrics
  WHERE sampler <> 'all'
  GROUP BY run_id, sampler
),
rewards AS (
  SELECT run_id, max(value) FILTER (WHERE name = 'rollout/in_group_reward_std') AS reward_std
  FROM latest_metrics
  WHERE sampler = 'all'
  GROUP BY run_id
),
firing AS (
  SELECT run_id, count(*) AS n FROM alerts WHERE state = 'firing' GROUP BY run_id
)
SELECT r.name AS "run", coalesce(r.project, '') AS "project", coalesce(d.sampler, '') AS "sampler",
  a.last_step AS "last step", d.mi_zscore_ema AS "MI z-score (EMA)",
  d.retrieval_above_chance AS "retrieval above chance", w.reward_std AS "reward std",
  coalesce(f.n, 0) AS "firing alerts", a.updated_at AS "updated"
FROM active a
JOIN runs r ON r.id = a.run_id
LEFT JOIN diagnostics d ON d.run_id = a.run_id
LEFT JOIN rewards w ON w.run_id = a.run_id
LEFT JOIN firing f ON f.run_id = a.run_id
ORDER BY coalesce(f.n, 0) DESC, r.name, d.sampler"""

OPEN_ALERTS_SQL = """SELECT r.name AS "run", a.sampler AS "sampler", a.rule AS "rule", a.severity AS "severity",
  a.state AS "state", a.onset_step AS "onset step", a.fired_step AS "fired step", a.last_step AS "last step",
  a.summary AS "summary", a.updated_at AS "updated"
FROM alerts a
JOIN runs r ON r.id = a.run_id
WHERE a.state IN ('pending', 'firing')
ORDER BY a.state = 'firing' DESC, a.updated_at DESC
LIMIT 200"""

RUN_LINK = (
    f"/d/{RUN_UID}/collapse-monitor-run?var-run=${{__data.fields.run}}"
    "&var-sampler=${__data.fields.sampler}&${__url_time_range}"
)


def fleet_dashboard() -> dict[str, Any]:
    board = base(
        FLEET_UID,
        "collapse-monitor: fleet",
        "Every active run at a glance, and the health of the scoring service.",
        "now-24h",
    )
    items: list[dashboard.Row | Panel] = [
        dashboard.Row("Active runs"),
        sql_table(
            "Active runs",
            "Runs that stored figures within the time range, one row per diagnostic sampler, newest values; "
            "runs with firing alerts first. Click a run to open its dashboard.",
            ACTIVE_RUNS_SQL,
            [
                ("run", [models.DynamicConfigValue("links", [{"title": "Open the run", "url": RUN_LINK}])]),
                ("retrieval above chance", [models.DynamicConfigValue("unit", RATIO)]),
                (
                    "firing alerts",
                    [
                        models.DynamicConfigValue("thresholds", red_from(1).build()),
                        models.DynamicConfigValue("custom.cellOptions", {"type": "color-background"}),
                    ],
                ),
            ],
            height=10,
        ),
        sql_table(
            "Open alerts",
            "Pending and firing alert episodes of every run, firing first.",
            OPEN_ALERTS_SQL,
            [("state", ALERT_STATE_COLOURS)],
        ),
        dashboard.Row("Service health"),
        current(
            "Queue depth", "Batches accepted and waiting to be scored.", "max(collapse_monitor_queue_depth)", NUMBER, 6
        ),
        current(
            "Batches in progress",
            "Batches being scored right now.",
            "max(collapse_monitor_batches_in_progress)",
            NUMBER,
            6,
        ),
        current(
            "Scorer throughput",
            "Tokens per second over the last 20 scored batches.",
            "max(collapse_monitor_scorer_tokens_per_second)",
            NUMBER,
            6,
        ),
        current(
            "Database reachable",
            "1 when every scraped process could read the database at its last scrape.",
            "min(collapse_monitor_database_up)",
            NUMBER,
            6,
        ),
        over_time(
            "Queue depth",
            "Batches waiting and being scored. A growing queue means scoring falls behind ingest.",
            [
                promql("max(collapse_monitor_queue_depth)", "queued", "A"),
                promql("max(collapse_monitor_batches_in_progress)", "in progress", "B"),
            ],
            NUMBER,
        ),
        over_time(
            "Scoring duration p50 / p99",
            "Wall time to score one batch, from the histogram. The histogram is read from the database, so "
            "every process exports the same one: `max by (le)` keeps one copy instead of summing them.",
            [
                promql(
                    "histogram_quantile(0.5, max by (le) "
                    "(rate(collapse_monitor_scoring_duration_seconds_bucket[$__rate_interval])))",
                    "p50",
                    "A",
                ),
                promql(
                    "histogram_quantile(0.99, max by (le) "
                    "(rate(collapse_monitor_scoring_duration_seconds_bucket[$__rate_interval])))",
                    "p99",
                    "B",
                ),
            ],
            "s",
        ),
        over_time(
            "Scorer tokens per second",
            "Scorer throughput over the last 20 scored batches.",
            [promql("max(collapse_monitor_scorer_tokens_per_second)", "tokens/s")],
            NUMBER,
        ),
        over_time(
            "Rejections by reason",
            "Requests refused per second, by reason (validation, not_found, too_large, queue_full, ...). "
            "Counted per process, so summed over processes.",
            [promql("sum by (reason) (rate(collapse_monitor_rejections_total[$__rate_interval]))", "{{reason}}")],
            "reqps",
        ),
        over_time(
            "Batches scored by outcome",
            "Batches finished per second: done or failed (read from the database, one copy kept).",
            [promql("max by (status) (rate(collapse_monitor_batches_scored_total[$__rate_interval]))", "{{status}}")],
            "ops",
        ),
    ]
    encoded = assemble(board, items)
    encoded["annotations"] = {"list": []}
    return encoded


# Output ------------------------------------------------------------------------------------------


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    boards = {"run.json": run_dashboard(), "fleet.json": fleet_dashboard()}
    return {name: json.dumps(board, indent=2, ensure_ascii=False) + "\n" for name, board in boards.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder to write into (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out / name
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if stale:
        sys.stderr.write(f"stale, rerun dashboards/build.py: {', '.join(stale)}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
