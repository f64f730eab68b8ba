"""`collapse-monitor serve` on a non-loopback address: refused without tokens, started with the flag or a token."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from tests.e2e.conftest import BIN, free_port, service_env, start_service
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
