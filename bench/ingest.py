"""Ingest speed: batches per second and latency of POST /v1/runs/{run}/batches, against /healthz.

    python bench/ingest.py [--requests 300] [--backends sqlite,postgres]

Starts ``collapse-monitor serve`` (one uvicorn process, scoring paused so that only ingest is
measured) on each backend, sends realistic batches (64 trajectories x 2 turns, ~1 KB of text per
turn) one after another over a keep-alive connection, and measures /healthz the same way in the
same run as the baseline. Prints one JSON object per backend.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import create_engine, text

PG_ADMIN = os.environ.get("COLLAPSE_MONITOR_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
BIN = Path(sys.executable).parent


def batch(step: int) -> dict:
    filler = "The box sits next to the wall; the goal is two tiles away and the hole blocks the middle row. "
    trajectories = []
    for t in range(64):
        turns = []
        for k in range(2):
            prompt = (
                f"<|im_start|>user\nTrajectory {t}, turn {k}. " + filler * 7 + "<|im_end|>\n<|im_start|>assistant\n"
            )
            response = "<think>" + filler * 2 + f"So I move {'Up' if k else 'Left'}.</think><answer>Up</answer>"
            turns.append({"prompt": prompt, "response": response})
        trajectories.append({"group_id": t // 8, "reward": float(t % 2), "turns": turns})
    return {"step": step, "batch_id": f"bench-{step}", "trajectories": trajectories}


def percentiles(latencies: list[float]) -> dict[str, float]:
    ms = np.array(latencies) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2)}


def measure(base: str, requests: int) -> dict:
    bodies = [json.dumps(batch(step)).encode() for step in range(requests + 20)]
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.post("/v1/runs", json={"name": "bench"}).status_code in (200, 201)
        for body in bodies[:20]:  # warm-up: connections, caches, first inserts
            http.post("/v1/runs/bench/batches", content=body, headers={"content-type": "application/json"})
            http.get("/healthz")
        ingest, health = [], []
        start = time.perf_counter()
        for body in bodies[20:]:
            t0 = time.perf_counter()
            response = http.post("/v1/runs/bench/batches", content=body, headers={"content-type": "application/json"})
            ingest.append(time.perf_counter() - t0)
            assert response.status_code == 202, response.text
        elapsed = time.perf_counter() - start
        for _ in range(requests):
            t0 = time.perf_counter()
            http.get("/healthz")
            health.append(time.perf_counter() - t0)
    return {
        "payload_bytes": len(bodies[-1]),
        "requests": requests,
        "batches_per_second": round(requests / elapsed, 1),
        "ingest": percentiles(ingest),
        "healthz": percentiles(health),
        "ingest_over_healthz_p50": round(float(np.median(ingest) / np.median(health)), 2),
    }


def serve(database_url: str, data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = 8700 + os.getpid() % 200
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLAPSE_MONITOR_")}
    env |= {
        "COLLAPSE_MONITOR_DATABASE_URL": database_url,
        "COLLAPSE_MONITOR_DATA_DIR": str(data_dir),
        "COLLAPSE_MONITOR_SCORING_PAUSED": "true",
        "COLLAPSE_MONITOR_MAX_QUEUE_DEPTH": "1000000",
    }
    process = subprocess.Popen(
        [str(BIN / "collapse-monitor"), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{base}/readyz").status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            database = f"cm_bench_{uuid.uuid4().hex[:8]}"
            admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
            if backend == "postgres":
                with admin.connect() as connection:
                    connection.execute(text(f'CREATE DATABASE "{database}"'))
                url = PG_ADMIN.rsplit("/", 1)[0] + f"/{database}"
            else:
                url = f"sqlite:///{Path(tmp) / 'bench.db'}"
            process, base = serve(url, Path(tmp))
            try:
                print(json.dumps({"backend": backend, **measure(base, args.requests)}))
            finally:
                process.terminate()
                process.wait()
                if backend == "postgres":
                    with admin.connect() as connection:
                        connection.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
                admin.dispose()


if __name__ == "__main__":
    main()
