"""The Grafana dashboards (dashboards/build.py's output), checked against real components.

No Grafana runs here, so each dashboard is checked piece by piece: its JSON structure against the
provisioning files, every SQL query on a seeded PostgreSQL, every PromQL expression with the real
promtool, and every metric name against the service's real /metrics.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.cli.dashboards import DASHBOARDS_DIR
from service.metrics import EXPORTED
from service.storage.database import migrate
from service.storage.tables import Alert, Batch, LatestMetric, MetricPoint, Run
from tests.e2e.conftest import need
from tests.fixtures import trajectories, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PROVISIONING = ROOT / "dashboards" / "provisioning"
METRIC = re.compile(r"\bcollapse_monitor_[a-z0-9_]+")
# $name, ${name} and ${name:format}; Grafana's own macros and variables start with "__".
VARIABLE = re.compile(r"\$\{?([A-Za-z_]\w*)")
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS_DIR.glob("*.json"))}


def provisioned() -> dict[str, str]:
    """uid -> type of every provisioned data source."""
    config = yaml.safe_load((PROVISIONING / "datasources.yml").read_text())
    return {source["uid"]: source["type"] for source in config["datasources"]}


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel and row, including the panels a collapsed row holds."""
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


@dataclass(frozen=True)
class Query:
    dashboard: str
    where: str  # "<panel title> [refId]", "variable $name" or "annotation <name>"
    datasource: str  # uid
    text: str


def queries() -> list[Query]:
    found = []
    for name, board in dashboards().items():
        for panel in panels(board):
            for target in panel.get("targets", []):
                uid = (target.get("datasource") or panel["datasource"])["uid"]
                text = target.get("rawSql") or target.get("expr")
                found.append(Query(name, f"{panel['title']} [{target['refId']}]", uid, text))
        for variable in board.get("templating", {}).get("list", []):
            if variable["type"] == "query":
                text = variable["query"] if isinstance(variable["query"], str) else variable["query"]["query"]
                found.append(Query(name, f"variable ${variable['name']}", variable["datasource"]["uid"], text))
        for annotation in board.get("annotations", {}).get("list", []):
            text = annotation["target"].get("rawSql") or annotation.get("expr")
            found.append(Query(name, f"annotation {annotation['name']}", annotation["datasource"]["uid"], text))
    return found


def of_type(kind: str) -> list[Query]:
    uids = {uid for uid, source_type in provisioned().items() if source_type == kind}
    return [q for q in queries() if q.datasource in uids]


# 1. Structure --------------------------------------------------------------------------------------


def test_both_dashboards_are_committed_and_the_provisioning_names_their_datasources():
    assert set(dashboards()) == {"run.json", "fleet.json"}
    sources = yaml.safe_load((PROVISIONING / "datasources.yml").read_text())["datasources"]
    assert provisioned() == {"collapse-prometheus": "prometheus", "collapse-postgres": "grafana-postgresql-datasource"}
    for source in sources:
        # Addresses and credentials come from Grafana's environment, never from the file.
        assert re.fullmatch(
            r"\$\{COLLAPSE_PROMETHEUS_URL\}|\$\{COLLAPSE_POSTGRES_HOST\}:\$\{COLLAPSE_POSTGRES_PORT\}", source["url"]
        )
    postgres = next(s for s in sources if s["uid"] == "collapse-postgres")
    assert postgres["user"] == "${COLLAPSE_POSTGRES_USER}"
    assert postgres["jsonData"]["database"] == "${COLLAPSE_POSTGRES_DB}"
    assert postgres["secureJsonData"]["password"] == "$COLLAPSE_POSTGRES_PASSWORD"
    provider = yaml.safe_load((PROVISIONING / "dashboards.yml").read_text())["providers"][0]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/collapse-monitor"


@pytest.mark.parametrize("name", ["run.json", "fleet.json"])
def test_every_panel_has_an_id_a_title_a_unit_targets_and_a_provisioned_datasource(name):
    board = dashboards()[name]
    sources = provisioned()
    assert isinstance(board["schemaVersion"], int)
    assert board["uid"]
    assert board["title"]
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}: {ids}"
    for panel in panels(board):
        if panel["type"] == "row":
            continue
        title = panel.get("title")
        assert title, f"{name}: panel {panel['id']} has no title"
        assert panel.get("description"), f"{name}: {title!r} has no description"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{name}: {title!r} has no unit"
        assert panel.get("targets"), f"{name}: {title!r} has no targets"
        refs = [panel["datasource"], *(t["datasource"] for t in panel["targets"] if "datasource" in t)]
        for ref in refs:
            assert sources.get(ref["uid"]) == ref["type"], f"{name}: {title!r} uses {ref}, not provisioned"
        for target in panel["targets"]:
            key = (
                "rawSql"
                if sources[(target.get("datasource") or panel["datasource"])["uid"]] != "prometheus"
                else "expr"
            )
            assert target.get(key), f"{name}: {title!r} target {target['refId']} has no {key}"
        if panel["type"] == "trend":
            assert panel["options"]["xField"] == "step", f"{name}: {title!r} must plot over the step column"
    for variable in board.get("templating", {}).get("list", []):
        assert sources.get(variable["datasource"]["uid"]) == variable["datasource"]["type"]
    for annotation in board.get("annotations", {}).get("list", []):
        assert sources.get(annotation["datasource"]["uid"]) == annotation["datasource"]["type"]


@pytest.mark.parametrize("name", ["run.json", "fleet.json"])
def test_panels_fit_the_grid_without_overlapping(name):
    boxes = [(p["title"], p["gridPos"]) for p in dashboards()[name]["panels"]]
    for title, box in boxes:
        assert 0 <= box["x"] < box["x"] + box["w"] <= 24, f"{title!r} leaves the 24-column grid: {box}"
    for i, (title_a, a) in enumerate(boxes):
        for title_b, b in boxes[i + 1 :]:
            apart = a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"] or a["y"] + a["h"] <= b["y"]
            assert apart or b["y"] + b["h"] <= a["y"], f"{title_a!r} overlaps {title_b!r}"


def test_the_run_dashboard_selects_a_run_and_every_query_uses_only_defined_variables():
    boards = dashboards()
    run_variables = {v["name"]: v for v in boards["run.json"]["templating"]["list"]}
    assert set(run_variables) == {"run", "sampler"}
    assert run_variables["run"]["datasource"]["uid"] == "collapse-postgres"
    assert not boards["fleet.json"].get("templating", {}).get("list")
    for query in queries():
        defined = set(run_variables) if query.dashboard == "run.json" else set()
        used = {name for name in VARIABLE.findall(query.text) if not name.startswith("__")}
        assert used <= defined, f"{query.dashboard} {query.where} uses undefined {used - defined}"


def test_the_committed_json_is_what_build_py_generates():
    pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk builds the dashboards (dev extra)")
    result = subprocess.run(
        [sys.executable, str(ROOT / "dashboards" / "build.py"), "--check"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


# 2. SQL on a seeded Postgres ----------------------------------------------------------------------

WINDOW_START = datetime.now(UTC) - timedelta(days=2)
WINDOW_END = datetime.now(UTC) + timedelta(hours=1)
VARIABLES = {"run": "run-a", "sampler": "first_turn"}

# The columns of an alert episode, in the run's episodes table and the fleet's open alerts alike.
EPISODE_COLUMNS = ["sampler", "rule", "severity", "state", "onset step", "fired step"]
# The columns each SQL query must answer with (Grafana reads them by name).
EXPECTED_COLUMNS = {
    ("run.json", "variable $run"): ["name"],
    ("run.json", "annotation Alerts firing"): ["time", "timeend", "text", "tags"],
    ("run.json", "annotation Alerts resolved"): ["time", "timeend", "text", "tags"],
    ("run.json", "MI estimate, 95% interval and ln N [A]"): [
        "step",
        "MI estimate",
        "95% CI low",
        "95% CI high",
        "ln N",
    ],
    ("run.json", "MI z-score [A]"): ["step", "MI z-score (EMA)", "MI z-score"],
    ("run.json", "Retrieval accuracy against chance [A]"): ["step", "retrieval accuracy", "chance level"],
    ("run.json", "Conditional entropy H(Z|X) and reasoning entropy H(Z) [A]"): [
        "step",
        "H(Z|X) conditional",
        "H(Z) reasoning",
    ],
    ("run.json", "Token entropy [A]"): ["step", "token entropy"],
    ("run.json", "Reward std and zero-variance groups [A]"): ["step", "reward std", "zero-variance groups"],
    ("run.json", "Filter kept ratio [A]"): ["step", "kept ratio"],
    ("run.json", "Alert episodes [A]"): [
        *EPISODE_COLUMNS,
        "resolved step",
        "value",
        "baseline",
        "threshold",
        "summary",
        "updated",
    ],
    ("fleet.json", "Active runs [A]"): [
        "run",
        "project",
        "sampler",
        "last step",
        "MI z-score (EMA)",
        "retrieval above chance",
        "reward std",
        "firing alerts",
        "updated",
    ],
    ("fleet.json", "Open alerts [A]"): [
        "run",
        *EPISODE_COLUMNS,
        "last step",
        "summary",
        "updated",
    ],
}


def grafana_sql(sql: str) -> str:
    """Expands the macros and variables the dashboards use, as Grafana's PostgreSQL data source does.

    $__timeFilter(col) -> col BETWEEN '<from>' AND '<to>'; $__timeFrom() / $__timeTo() -> '<from>' /
    '<to>' (RFC 3339, UTC); ${name:sqlstring} -> the value quoted, its quotes doubled.
    """

    def moment(value: datetime) -> str:
        return value.strftime("'%Y-%m-%dT%H:%M:%SZ'")

    sql = re.sub(
        r"\$__timeFilter\(([^)]+)\)",
        lambda m: f"{m.group(1)} BETWEEN {moment(WINDOW_START)} AND {moment(WINDOW_END)}",
        sql,
    )
    sql = sql.replace("$__timeFrom()", moment(WINDOW_START)).replace("$__timeTo()", moment(WINDOW_END))
    for name, value in VARIABLES.items():
        sql = sql.replace(f"${{{name}:sqlstring}}", "'" + value.replace("'", "''") + "'")
    assert "$" not in sql, f"unexpanded macro or variable left in:\n{sql}"
    return sql


def seed(url: str) -> None:
    """Two runs: run-a active (3 scored steps, a firing, a resolved and a pending alert), run-b idle for a month."""
    now = datetime.now(UTC)
    engine = create_engine(url)
    with Session(engine) as session, session.begin():
        active = Run(name="run-a", project="rl-agents", scorer="tiny-random", scorer_mode="reference")
        idle = Run(name="run-b", scorer="tiny-random", scorer_mode="reference", created_at=now - timedelta(days=40))
        session.add_all([active, idle])
        session.flush()
        for step in (1, 2, 3):
            batch = Batch(
                id=f"batch{step}",
                run_id=active.id,
                step=step,
                kind="matrix",
                payload="{}",
                payload_sha256="0" * 64,
                status="done",
            )
            session.add(batch)
            session.flush()
            for sampler in ("first_turn", "all"):
                for index, exported in enumerate(EXPORTED):
                    session.add(
                        MetricPoint(
                            run_id=active.id,
                            batch_id=batch.id,
                            step=step,
                            sampler=sampler,
                            name=exported.stored,
                            value=index + step / 10,
                            created_at=now - timedelta(hours=4 - step),
                        )
                    )
        for sampler in ("first_turn", "all"):
            for index, exported in enumerate(EXPORTED):
                session.add(
                    LatestMetric(
                        run_id=active.id,
                        sampler=sampler,
                        name=exported.stored,
                        step=3,
                        value=index + 0.3,
                        updated_at=now,
                    )
                )
        session.add(
            LatestMetric(
                run_id=idle.id,
                sampler="first_turn",
                name="mi_zscore_ema",
                step=9,
                value=1.0,
                updated_at=now - timedelta(days=30),
            )
        )
        columns = ("sampler", "rule", "severity", "state", "onset_step", "fired_step", "resolved_step", "last_step")
        episodes = [
            ("first_turn", "TemplateCollapse", "critical", "firing", 2, 3, None, 3),
            ("first_turn", "EntropyCollapse", "warning", "resolved", 1, 1, 2, 2),
            ("all", "LowRewardSignal", "warning", "pending", 3, None, None, 3),
        ]
        for hours_ago, episode in enumerate(episodes, start=1):
            sampler, rule = episode[:2]
            session.add(
                Alert(
                    run_id=active.id,
                    **dict(zip(columns, episode, strict=True)),
                    value=0.1,
                    baseline=2.0,
                    threshold=0.5,
                    summary=f"{rule} on run-a/{sampler}",
                    description="seeded",
                    created_at=now - timedelta(hours=hours_ago + 1),
                    updated_at=now - timedelta(hours=hours_ago),
                )
            )
    engine.dispose()


def run_sql(url: str, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    # The DB-API cursor directly, so that no layer reads "%" or ":" in the SQL as a placeholder.
    engine = create_engine(url)
    try:
        connection = engine.raw_connection()
        try:
            cursor = connection.cursor()
            cursor.execute(sql)
            return [column[0] for column in cursor.description], list(cursor.fetchall())
        finally:
            connection.close()
    finally:
        engine.dispose()


def test_every_sql_query_runs_on_a_seeded_postgres_and_answers_the_expected_columns(postgres_url):
    migrate(postgres_url)
    seed(postgres_url)
    sql_queries = of_type("grafana-postgresql-datasource")
    assert {(q.dashboard, q.where) for q in sql_queries} == set(EXPECTED_COLUMNS)
    answers = {}
    for query in sql_queries:
        columns, rows = run_sql(postgres_url, grafana_sql(query.text))
        where = f"{query.dashboard} {query.where}"
        assert columns == EXPECTED_COLUMNS[(query.dashboard, query.where)], where
        assert rows, f"{where} answered no rows"
        for i, column in enumerate(columns):
            # A misspelt stored name would leave its column empty while the others fill.
            assert any(row[i] is not None for row in rows), f"{where}: column {column!r} is empty"
        answers[(query.dashboard, query.where)] = [dict(zip(columns, row, strict=True)) for row in rows]

    assert [row["name"] for row in answers[("run.json", "variable $run")]] == ["run-a", "run-b"]  # newest first
    assert [r["text"] for r in answers[("run.json", "annotation Alerts firing")]] == [
        "TemplateCollapse on run-a/first_turn (TemplateCollapse, first_turn, onset step 2)"
    ]
    assert (
        answers[("run.json", "annotation Alerts resolved")][0]["tags"] == "resolved,warning,EntropyCollapse,first_turn"
    )
    assert [row["step"] for row in answers[("run.json", "MI z-score [A]")]] == [1, 2, 3]
    active = answers[("fleet.json", "Active runs [A]")]
    assert [(r["run"], r["sampler"], r["last step"], r["firing alerts"]) for r in active] == [
        ("run-a", "first_turn", 3, 1)
    ]
    assert {r["state"] for r in answers[("fleet.json", "Open alerts [A]")]} == {"firing", "pending"}


# 3. PromQL through promtool ------------------------------------------------------------------------

PROMQL_VALUES = {"run": '"run-a"', "sampler": '"first_turn"', "__rate_interval": "1m"}


def promql(expr: str) -> str:
    """The expression Prometheus receives: label_values(...) is Grafana's, so its selector is checked."""
    match = LABEL_VALUES.match(expr.strip())
    if match:
        expr = match["selector"]
    # The dashboards quote their variables ("$run"); the values replace the quotes too.
    expr = re.sub(r'"\$(\w+)"', lambda m: PROMQL_VALUES[m[1]], expr)
    expr = re.sub(r"\$(\w+)", lambda m: PROMQL_VALUES[m[1]], expr)
    assert "$" not in expr, expr
    return expr


def promtool_check(tmp_path: Path, expressions: list[str]) -> subprocess.CompletedProcess[str]:
    rules = {
        "groups": [
            {
                "name": "dashboards",
                "rules": [{"record": f"dashboard:check_{i}", "expr": e} for i, e in enumerate(expressions)],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return subprocess.run(
        [need("promtool"), "check", "rules", str(path)], capture_output=True, text=True, check=False, timeout=60
    )


def test_every_promql_expression_passes_promtool(tmp_path):
    expressions = [promql(q.text) for q in of_type("prometheus")]
    assert len(expressions) > 20
    result = promtool_check(tmp_path, expressions)
    rules = "\n".join(f"dashboard:check_{i} = {q.dashboard} {q.where}" for i, q in enumerate(of_type("prometheus")))
    assert result.returncode == 0, f"{result.stdout}{result.stderr}\n{rules}"
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout
    # The check is real: a broken expression fails it.
    broken = promtool_check(tmp_path, ['max(collapse_monitor_queue_depth{run="x"}'])
    assert broken.returncode != 0


# 4. Metric names in the real /metrics ---------------------------------------------------------------


def test_every_metric_and_label_the_dashboards_use_has_samples_in_the_service_exposition(tmp_path, client_for):
    client = client_for(f"sqlite:///{tmp_path / 'monitor.db'}")
    assert client.post("/v1/runs", json={"name": "run-a", "sampler": {"num_samples": 6}}).status_code == 201
    accepted = client.post("/v1/runs/run-a/batches", json={"step": 1, "trajectories": trajectories()}).json()
    assert wait_for(client, accepted["batch_id"])["status"] == "done"
    matrix = {
        "step": 2,
        "row_group_ids": [0, 0, 1, 1],
        "reasoning_lengths": [3, 4, 2, 5],
        "L_seq": [[-3, -9], [-4, -10], [-8, -2], [-12, -5]],
        "sampler": "matrix",
    }
    assert client.post("/v1/runs/run-a/matrices", json=matrix).status_code == 201
    assert client.post("/v1/runs/run-a/matrices", json={}).status_code == 422  # a rejection, counted by reason
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:  # counters appear as <name>_total samples, histograms as _bucket
            samples.setdefault(sample.name, []).append(sample.labels)

    texts = [promql(q.text) for q in of_type("prometheus")]
    used = {name for text in texts for name in METRIC.findall(text)}
    assert used, "the dashboards name no metric"
    assert used <= set(samples), f"not in /metrics (or without samples): {sorted(used - set(samples))}"
    for text in texts:
        for name, matchers in re.findall(r"(collapse_monitor_[a-z0-9_]+)\{([^}]*)\}", text):
            for label, value in re.findall(r'(\w+)="([^"]*)"', matchers):
                values = {labels.get(label) for labels in samples[name]}
                assert value in values, f"{name} has no sample with {label}={value!r} (has {values})"
        for grouping in re.findall(r"\bby \(([^)]*)\)", text):
            for label in (part.strip() for part in grouping.split(",")):
                carried = any(label in labels for name in METRIC.findall(text) for labels in samples[name])
                assert carried, f"no sample carries the label {label!r} grouped by in {text}"
