"""Ingest speed: batches per second and latency of POST /v1/runs/{run}/batches, against /healthz.

    python bench/ingest.py [--requests 300] [--backends sqlite,postgres]
    python bench/ingest.py --clients 8,32 [--requests 100] [--backends postgres]
    python bench/ingest.py --scoring-under-load 32 [--backends sqlite,postgres]

Starts ``collapse-monitor serve`` (one uvicorn process) on each backend and sends realistic
batches (64 trajectories x 2 turns, ~1 KB of text per turn). Sequential (default): one client over
a keep-alive connection, scoring paused, /healthz measured the same way in the same run as the
baseline. ``--clients``: that many concurrent clients, each its own run, ``--requests`` batches
each. ``--scoring-under-load N``: the embedded worker scores a fixed set of small batches (tiny
model) once idle and once while N clients ingest; the ratio of the two throughputs is the cost
of ingest to scoring. Rate limits and per-run queue limits are off, so that only the server's
work is measured. Prints one JSON object per measurement.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time

import httpx
import numpy as np
from serving import database, percentiles, served

JSON = {"content-type": "application/json"}


def batch(step: int) -> dict:
    filler = "The box sits next to the wall; the goal is two tiles away and the hole blocks the middle row. "
    trajectories = []
    for t in range(64):
        turns = []
        for k in range(2):
            prompt = (
                f"<|im_start|>user\nBoard {t // 8}, turn {k}. " + filler * 7 + "<|im_end|>\n<|im_start|>assistant\n"
            )
            action = "Up" if k else "Left"
            response = "<think>" + filler * 2 + f"Rollout {t}: I move {action}.</think><answer>{action}</answer>"
            turns.append({"prompt": prompt, "response": response})
        trajectories.append({"group_id": t // 8, "reward": float(t % 2), "turns": turns})
    return {"step": step, "idempotency_key": f"bench-{step}", "trajectories": trajectories}


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


def concurrent(base: str, clients: int, requests: int, rate: float = 0.0) -> dict:
    """``clients`` trainers at once, each posting ``requests`` batches to its own run.

    ``rate`` 0: each as fast as it can (closed loop: latency then measures the queue in front of the
    server as much as the server). Otherwise each sends ``rate`` batches per second on a schedule
    (open loop, as trainers do: a batch per training step), so latency is the server's answer time
    at that load.
    """
    bodies = [json.dumps(batch(step)).encode() for step in range(requests)]
    latencies: list[list[float]] = [[] for _ in range(clients)]
    barrier = threading.Barrier(clients + 1)

    def trainer(i: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as http:
            http.post("/v1/runs", json={"name": f"load-{i}"})
            http.post(f"/v1/runs/load-{i}/batches", content=bodies[0], headers=JSON)  # warm-up
            barrier.wait()
            start = time.perf_counter() + (i / clients / rate if rate else 0.0)  # spread the clients' phases
            for n, body in enumerate(bodies[1:]):
                if rate:
                    time.sleep(max(0.0, start + n / rate - time.perf_counter()))
                t0 = time.perf_counter()
                response = http.post(f"/v1/runs/load-{i}/batches", content=body, headers=JSON)
                latencies[i].append(time.perf_counter() - t0)
                assert response.status_code == 202, response.text

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    every = [t for per_client in latencies for t in per_client]
    return {
        "clients": clients,
        "per_client_rate": rate or "as fast as it can",
        "requests": len(every),
        "batches_per_second": round(len(every) / elapsed, 1),
        "ingest": percentiles(every),
    }


def scoring_throughput(base: str, clients: int, batches: int = 12) -> dict:
    """Batches/s of the embedded worker on small batches, idle and while ``clients`` ingest (ratio in one run)."""
    small = [
        {
            "group_id": g,
            "reward": float(k % 2),
            "turns": [{"prompt": f"Board {g}.", "response": f"<think>{k} {g}</think>"}],
        }
        for g in range(4)
        for k in range(2)
    ]

    def score_all(run: str) -> float:
        with httpx.Client(base_url=base, timeout=60) as http:
            http.post("/v1/runs", json={"name": run, "sampler": {"num_samples": 8}})
            start = time.perf_counter()
            ids = [
                http.post(f"/v1/runs/{run}/batches", json={"step": s, "trajectories": small}).json()["batch_id"]
                for s in range(1, batches + 1)
            ]
            while http.get(f"/v1/batches/{ids[-1]}").json()["status"] not in ("done", "failed"):
                time.sleep(0.02)
            return batches / (time.perf_counter() - start)

    idle = score_all("scored-idle")
    stop = threading.Event()

    def trainer(i: int) -> None:
        body = json.dumps(batch(0) | {"idempotency_key": None}).encode()
        with httpx.Client(base_url=base, timeout=60) as http:
            http.post("/v1/runs", json={"name": f"noise-{i}", "schedule": {"every": 1_000_000}})
            step = 2  # off the schedule: these batches are only stored (and their rewards summarised)
            while not stop.is_set():
                http.post(
                    f"/v1/runs/noise-{i}/batches",
                    content=body.replace(b'"step": 0', f'"step": {step}'.encode()),
                    headers=JSON,
                )
                step += 1

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    loaded = score_all("scored-loaded")
    stop.set()
    for thread in threads:
        thread.join()
    return {
        "ingest_clients": clients,
        "scored_batches_per_second_idle": round(idle, 2),
        "scored_batches_per_second_under_load": round(loaded, 2),
        "under_load_over_idle": round(loaded / idle, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--clients", help="comma-separated numbers of concurrent clients, e.g. 8,32")
    parser.add_argument("--rate", type=float, default=0.0, help="batches per second per client (0: closed loop)")
    parser.add_argument("--scoring-under-load", type=int, metavar="N", help="ingesting clients while scoring")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp, database(backend, tmp) as url:
            settings = {
                "DATABASE_URL": url,
                "DATA_DIR": tmp,
                "SCORING_PAUSED": "false" if args.scoring_under_load is not None else "true",
                "DEFAULT_SCORER": "tiny-random",
                "MAX_QUEUE_DEPTH": "1000000",
                "MAX_QUEUED_PER_RUN": "1000000",
                "RATE_LIMIT_PER_SECOND": "0",
            }
            with served(settings) as base:
                if args.scoring_under_load is not None:
                    print(json.dumps({"backend": backend, **scoring_throughput(base, args.scoring_under_load)}))
                elif args.clients:
                    for clients in (int(n) for n in args.clients.split(",")):
                        result = concurrent(base, clients, args.requests, args.rate)
                        print(json.dumps({"backend": backend, **result}))
                else:
                    print(json.dumps({"backend": backend, **measure(base, args.requests)}))


if __name__ == "__main__":
    main()
