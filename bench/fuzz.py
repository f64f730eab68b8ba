"""Schema fuzzing figures: how many generated requests, and how many got a 5xx, per backend.

    python bench/fuzz.py [--examples 100] [--backends sqlite,postgres]

Runs schemathesis (the ``.venv-fuzz`` that scripts/test creates) over every operation of
``/openapi.json`` of a ``collapse-monitor serve`` (tiny-random scorer, embedded worker), with the
run and batch path parameters pointing at a real run, as ``tests/e2e/test_fuzz.py`` does with
fewer examples; then reads the server's own request counter, so the figures count what reached
the service, by status. Prints one JSON object per backend.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import httpx
from serving import database, served

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures import trajectories  # noqa: E402

SCHEMATHESIS = ROOT / ".venv-fuzz" / "bin" / "schemathesis"
REQUESTS = re.compile(r'^collapse_monitor_requests_total\{method="(\w+)",route="([^"]*)",status="(\d+)"\} (\S+)$', re.M)


def fuzz(base: str, folder: Path, examples: int) -> dict[str, object]:
    assert httpx.post(f"{base}/v1/runs", json={"name": "fuzz", "sampler": {"num_samples": 4}}).status_code == 201
    batch = httpx.post(f"{base}/v1/runs/fuzz/batches", json={"step": 1, "trajectories": trajectories()}).json()
    config = folder / "schemathesis.toml"
    config.write_text(f'[parameters]\n"path.run" = "fuzz"\n"path.batch_id" = "{batch["batch_id"]}"\n')
    done = subprocess.run(
        [
            *(str(SCHEMATHESIS), "--config-file", str(config), "run", f"{base}/openapi.json"),
            *("--checks", "not_a_server_error,negative_data_rejection", "--max-examples", str(examples)),
            *("--workers", "1", "--request-timeout", "30", "--no-color", "--seed", "20261201"),
        ],
        capture_output=True,
        text=True,
        cwd=folder,
    )
    by_status: Counter[str] = Counter()
    for _method, route, status, count in REQUESTS.findall(httpx.get(f"{base}/metrics").text):
        if route.startswith("/v1/") or route == "unmatched":
            by_status[status] += int(float(count))
    return {
        "examples_per_operation": examples,
        "schemathesis_exit_code": done.returncode,
        "requests": sum(by_status.values()),
        "by_status": dict(sorted(by_status.items())),
        "server_errors": sum(n for status, n in by_status.items() if status.startswith("5")),
        "summary": [line for line in done.stdout.splitlines() if "passed" in line or "failed" in line][-3:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()
    if not SCHEMATHESIS.exists():
        raise SystemExit(f"{SCHEMATHESIS} is missing; scripts/test creates it")
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp, database(backend, tmp) as url:
            # The rate limit off: otherwise most generated requests would only measure it (429).
            settings = {
                "DATABASE_URL": url,
                "DATA_DIR": tmp,
                "DEFAULT_SCORER": "tiny-random",
                "RATE_LIMIT_PER_SECOND": "0",
            }
            with served(settings) as base:
                print(json.dumps({"backend": backend, **fuzz(base, Path(tmp), args.examples)}), flush=True)


if __name__ == "__main__":
    main()
