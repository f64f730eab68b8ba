"""What API tokens cost ingest: POST /v1/runs/{run}/batches latency without tokens, with a token (cached
lookup, the default), and with a token looked up on every request (``token_cache_seconds=0``).

    python bench/tokens.py [--requests 300] [--backend sqlite|postgres]

Starts three ``collapse-monitor serve`` processes on three databases of the backend (scoring paused,
rate limit off) and sends them the same batches in turn, one request to each in every round, so
that the machine's load (shared, noisy) falls on the three alike; the ratios of medians within the
run are the result. Two batch sizes: realistic (64 trajectories x 2 turns, as bench/ingest.py) and
small (4 one-turn trajectories), where a fixed per-request cost shows most. Prints one JSON object
per batch size.
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
from ingest import batch  # bench/ingest.py: the realistic batch
from sqlalchemy import create_engine, text

PG_ADMIN = os.environ.get("COLLAPSE_MONITOR_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
BIN = Path(sys.executable).parent
JSON = {"content-type": "application/json"}
VARIANTS = ("no_token", "token_cached", "token_uncached")


def small(step: int) -> dict:
    trajectories = [
        {"group_id": g, "reward": 1.0, "turns": [{"prompt": f"Board {g}.", "response": f"<think>{g}</think>Up"}]}
        for g in range(4)
    ]
    return {"step": step, "trajectories": trajectories}


def start(url: str, folder: Path, port: int, cache_seconds: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLAPSE_MONITOR_")}
    env |= {
        "COLLAPSE_MONITOR_DATABASE_URL": url,
        "COLLAPSE_MONITOR_DATA_DIR": str(folder),
        "COLLAPSE_MONITOR_SCORING_PAUSED": "true",
        "COLLAPSE_MONITOR_DEFAULT_SCORER": "tiny-random",
        "COLLAPSE_MONITOR_MAX_QUEUE_DEPTH": "1000000",
        "COLLAPSE_MONITOR_MAX_QUEUED_PER_RUN": "1000000",
        "COLLAPSE_MONITOR_RATE_LIMIT_PER_SECOND": "0",
        "COLLAPSE_MONITOR_TOKEN_CACHE_SECONDS": cache_seconds,
    }
    return subprocess.Popen(
        [str(BIN / "collapse-monitor"), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def create_token(url: str) -> str:
    out = subprocess.run(
        [str(BIN / "collapse-monitor"), "tokens", "create", "--scope", "ingest", "--database-url", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    token: str = json.loads(out)["token"]
    return token


def wait_ready(base: str) -> None:
    for _ in range(600):
        try:
            if httpx.get(f"{base}/readyz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{base} did not start")


def run(urls: dict[str, str], folder: Path, requests: int) -> None:
    tokens = {name: create_token(url) for name, url in urls.items() if name != "no_token"}
    processes, clients = [], {}
    try:
        for i, (name, url) in enumerate(urls.items()):
            port = 8900 + (os.getpid() + i) % 90
            processes.append(start(url, folder / name, port, "0" if name == "token_uncached" else "2"))
            base = f"http://127.0.0.1:{port}"
            wait_ready(base)
            headers = {"Authorization": f"Bearer {tokens[name]}"} if name in tokens else {}
            clients[name] = httpx.Client(base_url=base, timeout=30, headers=headers)
        for size, make in (("realistic", batch), ("small", small)):
            run_name = f"bench-{size}"
            bodies = [
                json.dumps(make(step) | {"idempotency_key": f"{size}-{step}"}).encode() for step in range(requests + 20)
            ]
            latencies: dict[str, list[float]] = {name: [] for name in clients}
            for client in clients.values():
                assert client.post("/v1/runs", json={"name": run_name}).status_code == 201
            for n, body in enumerate(bodies):
                for name, client in clients.items():
                    t0 = time.perf_counter()
                    response = client.post(f"/v1/runs/{run_name}/batches", content=body, headers=JSON)
                    if n >= 20:  # the first 20: warm-up (connections, caches, first inserts)
                        latencies[name].append(time.perf_counter() - t0)
                    assert response.status_code == 202, response.text
            p50 = {name: float(np.median(values)) * 1000 for name, values in latencies.items()}
            print(
                json.dumps(
                    {
                        "batch": size,
                        "payload_bytes": len(bodies[-1]),
                        "requests": requests,
                        "p50_ms": {name: round(value, 2) for name, value in p50.items()},
                        "token_cached_over_no_token": round(p50["token_cached"] / p50["no_token"], 3),
                        "token_uncached_over_no_token": round(p50["token_uncached"] / p50["no_token"], 3),
                    }
                )
            )
    finally:
        for client in clients.values():
            client.close()
        for process in processes:
            process.terminate()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
        names = {variant: f"cm_bench_{variant}_{uuid.uuid4().hex[:6]}" for variant in VARIANTS}
        if args.backend == "postgres":
            with admin.connect() as connection:
                for database in names.values():
                    connection.execute(text(f'CREATE DATABASE "{database}"'))
            urls = {variant: PG_ADMIN.rsplit("/", 1)[0] + f"/{database}" for variant, database in names.items()}
        else:
            urls = {variant: f"sqlite:///{folder / variant}.db" for variant in VARIANTS}
        try:
            run(urls, folder, args.requests)
        finally:
            if args.backend == "postgres":
                with admin.connect() as connection:
                    for database in names.values():
                        connection.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
            admin.dispose()


if __name__ == "__main__":
    main()
