"""Dependencies point one way: scoring never pulls in the service stack."""

from __future__ import annotations

import subprocess
import sys


def modules_loaded_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_scoring_imports_no_http_sql_or_prometheus():
    loaded = modules_loaded_by("import scoring, scoring.estimators, scoring.samplers, scoring.snr_filter")
    assert not loaded & {"fastapi", "sqlalchemy", "prometheus_client", "service", "starlette", "uvicorn"}


def test_wire_schemas_import_no_web_framework():
    loaded = modules_loaded_by("import service.schemas")
    assert not loaded & {"fastapi", "starlette", "sqlalchemy"}


def test_storage_metrics_alerts_and_delivery_import_no_web_framework():
    loaded = modules_loaded_by(
        "import service.storage.queries, service.storage.database, service.metrics, service.alerts, service.delivery"
    )
    assert not loaded & {"fastapi", "starlette", "uvicorn"}
