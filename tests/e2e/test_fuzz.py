"""Schema fuzzing over real HTTP: no generated request, valid or not, makes the service answer 5xx.

Schemathesis (its own venv, ``.venv-fuzz``: its HTTP stack clashes with grafana-client's in ours)
generates requests for every operation of ``/openapi.json`` from its examples, its schema's edge
cases and random data, with the run and batch path parameters pointing at a real run, and checks
that none gets a server error and that none violating the schema is accepted. Bounded: a few dozen
examples per operation.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, select

from service.storage.tables import Batch
from tests.e2e.conftest import service_env, start_service
from tests.fixtures import trajectories

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SCHEMATHESIS = ROOT / ".venv-fuzz" / "bin" / "schemathesis"
EXAMPLES = 25


def test_fuzzed_requests_never_get_a_server_error(processes, tmp_path, database_url):
    if not SCHEMATHESIS.exists():
        message = f"{SCHEMATHESIS} is missing; scripts/test installs it"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    # The rate limit off: at its default most generated requests would get 429 before validation.
    env = service_env(tmp_path, database_url, COLLAPSE_MONITOR_RATE_LIMIT_PER_SECOND="0")
    base = start_service(processes, env)
    assert httpx.post(f"{base}/v1/runs", json={"name": "fuzz", "sampler": {"num_samples": 4}}).status_code == 201
    batch = httpx.post(f"{base}/v1/runs/fuzz/batches", json={"step": 1, "trajectories": trajectories()}).json()
    config = tmp_path / "schemathesis.toml"
    config.write_text(f'[parameters]\n"path.run" = "fuzz"\n"path.batch_id" = "{batch["batch_id"]}"\n')
    result = subprocess.run(
        [
            str(SCHEMATHESIS),
            "--config-file",
            str(config),
            "run",
            f"{base}/openapi.json",
            "--checks",
            "not_a_server_error,negative_data_rejection",
            "--max-examples",
            str(EXAMPLES),
            "--workers",
            "1",
            "--request-timeout",
            "30",
            "--no-color",
            "--seed",
            "20261201",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "passed" in result.stdout
    assert "Traceback" not in processes.log("serve")
    # Nothing fuzzed was left to fail as if a worker had crashed.
    engine = create_engine(database_url)
    with engine.connect() as connection:
        errors = connection.execute(select(Batch.error).where(Batch.status == "failed")).scalars().all()
    engine.dispose()
    assert not [e for e in errors if "interrupted" in (e or "")]
