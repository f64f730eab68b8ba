"""`collapse-monitor serve` on a non-loopback address: refused without tokens, started with the flag or a token."""

from __future__ import annotations

import functools
import json
import subprocess

import httpx
import pytest

from bench.serving import BIN, free_port, issue_token, wait_until
from service.cli.demo import run_demo
from tests.e2e.conftest import need, service_env, start_prometheus, start_service
from tests.fixtures import dependence_matrix

pytestmark = pytest.mark.e2e


def test_serve_refuses_a_non_loopback_bind_without_tokens_unless_told_or_a_token_exists(tmp_path, processes):
    env = service_env(tmp_path)
    port = free_port()
    refused = subprocess.run(
        [str(BIN / "collapse-monitor"), "serve", "--host", "0.0.0.0", "--port", str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1] == (
        "error: --host 0.0.0.0 is not a loopback address and no API token exists, so anyone who reaches the port "
        "could write into any run and read it; create a token first (collapse-monitor tokens create --scope "
        "admin), or pass --allow-insecure-bind (COLLAPSE_MONITOR_ALLOW_INSECURE_BIND=true) on a network you trust"
    )
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz")

    insecure = start_service(processes, env, "--host", "0.0.0.0", "--allow-insecure-bind")
    assert httpx.post(f"{insecure}/v1/runs", json={"name": "open"}).status_code == 201
    assert "anyone who reaches the port can write" in processes.log("serve")
    processes.stop_all()

    created = subprocess.run(
        [str(BIN / "collapse-monitor"), "tokens", "create", "--scope", "admin", "--name", "ops"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    token = json.loads(created.stdout)["token"]
    secured = start_service(processes, env, "--host", "0.0.0.0")
    with httpx.Client(base_url=secured, timeout=30) as api:
        refused_write = api.post("/v1/runs/open/matrices", json=dependence_matrix(1, 1.0))
        assert refused_write.status_code == 401
        assert refused_write.headers["www-authenticate"].startswith("Bearer")
        accepted = api.post(
            "/v1/runs/open/matrices", json=dependence_matrix(1, 1.0), headers={"Authorization": f"Bearer {token}"}
        )
        assert accepted.status_code == 201
        assert api.get("/v1/runs/open").json()["last_step"] == 1  # reads stay open by default
    demo = functools.partial(
        run_demo, secured, "demo-guarded", steps=2, collapse_start=1, groups=2, per_group=2, report=lambda _: None
    )
    with pytest.raises(RuntimeError, match=r"creating the run failed \(401\)"):
        demo()
    statuses = demo(token=token)
    assert [s.status for s in statuses] == ["done", "done"]


def test_prometheus_scrapes_metrics_that_need_a_token_with_a_read_token_from_a_file(tmp_path, processes):
    need("prometheus")  # skipped (or failed under CI) before anything starts
    env = service_env(tmp_path, COLLAPSE_MONITOR_REQUIRE_TOKEN_FOR_METRICS="true")
    tokens = {
        scope: issue_token(env, "--scope", scope, "--name", f"prometheus-{scope}") for scope in ("read", "ingest")
    }
    base = start_service(processes, env)
    ingest = {"Authorization": f"Bearer {tokens['ingest']}"}
    assert httpx.post(f"{base}/v1/runs", json={"name": "scraped"}, headers=ingest).status_code == 201
    assert httpx.post(f"{base}/v1/runs/scraped/matrices", json=dependence_matrix(1, 1.0), headers=ingest).is_success

    credentials = tmp_path / "collapse-monitor.token"
    credentials.write_text(tokens["read"] + "\n")
    target = base.removeprefix("http://")
    query = start_prometheus(
        processes,
        tmp_path,
        f"  - job_name: with-token\n    static_configs: [{{targets: ['{target}']}}]\n"
        f"    authorization: {{credentials_file: {credentials}}}\n"
        f"  - job_name: without-token\n    static_configs: [{{targets: ['{target}']}}]\n",
    )
    up: dict[str, float] = {}

    def scraped_both() -> bool:
        answer = httpx.get(query, params={"query": "up"})
        if answer.status_code != 200:  # Prometheus answers 503 until its storage is ready
            return False
        result = answer.json()["data"]["result"]
        up.update({r["metric"]["job"]: float(r["value"][1]) for r in result})
        return len(up) == 2

    wait_until(scraped_both, 60, "Prometheus to scrape both jobs")
    assert up == {"with-token": 1.0, "without-token": 0.0}
    mi = httpx.get(query, params={"query": 'collapse_monitor_mi_estimate_nats{run="scraped"}'}).json()["data"]
    assert [r["metric"]["job"] for r in mi["result"]] == ["with-token"]
