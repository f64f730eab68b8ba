"""Scoring under ingest load (issue 19, item 5): what 32 trainers posting 1 batch/s cost the worker.

    python bench/ingest_load.py [--backends sqlite,postgres] [--scorer tiny-random] [--noise off-schedule]
    python bench/ingest_load.py --scorer smollm2-135m [--seconds 30]
    python bench/ingest_load.py --worker process --backends postgres

One ``collapse-monitor serve`` per backend (rate and queue limits off) that scores in its embedded worker
(``--worker embedded``) or, with ``--worker process`` (Postgres only), does not, beside one
``collapse-monitor worker`` process on the same database, so that the requests and the scoring hold a
GIL each. A scored run
of small steps (4 prompts x 2 rollouts) is kept ahead of the worker; its throughput is the steps
done per second over ``--seconds``. Measured alone, then while ``--trainers``
noise trainers each post one batch a second (phases spread) of batches that need no scoring:

- ``off-schedule``: 64-trajectory batches to runs created with ``schedule: {"every": 1000000}``,
  steps 2, 3, ...: their figures computed and recorded in the request (answered ``done``), never queued;
- ``matrices``: a 64 x 16 matrix to ``POST /v1/runs/{run}/matrices``: diagnosed in the request, no worker.

Prints one JSON object per (backend, noise): both throughputs, their ratio (target: the load costs
at most 20%, ratio >= 0.8), the noise requests' p50/p99 latency and errors, and the machine's 1-minute
load average at the start and end of each phase (the ratio only means something on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from contextlib import nullcontext
from typing import Any

import httpx
import numpy as np

from bench.serving import database, percentiles, served, worker_process

JSON = {"content-type": "application/json"}
NOISE_KINDS = ("off-schedule", "matrices")


def scored_step(step: int) -> dict[str, Any]:
    trajectories = [
        {
            "group_id": g,
            "reward": float(k % 2),
            "turns": [
                {"prompt": f"Board {g}: move the box to the goal.", "response": f"<think>try {k} on {g}</think>"}
            ],
        }
        for g in range(4)
        for k in range(2)
    ]
    return {"step": step, "trajectories": trajectories}


def noise_body(kind: str, rng: np.random.Generator) -> bytes:
    """One noise batch, with "step": 0 to be replaced by the poster."""
    if kind == "matrices":
        groups = [g for g in range(16) for _ in range(4)]
        L_seq = rng.normal(-40, 5, size=(64, 16)).round(3).tolist()
        body = {
            "step": 0,
            "row_group_ids": groups,
            "reasoning_lengths": [40] * 64,
            "L_seq": L_seq,
            "rewards": [float(r % 2) for r in range(64)],
        }
    else:
        text = "The box is two squares left of the goal; push it right, then up. " * 16  # ~1 KB
        body = {
            "step": 0,
            "trajectories": [
                {"group_id": g, "reward": float(k % 2), "turns": [{"prompt": f"Board {g}. " + text, "response": text}]}
                for g in range(16)
                for k in range(4)
            ],
        }
    return json.dumps(body).encode()


class ScoredRun:
    """The scored run: its steps posted ahead of the worker, and how many of them are done."""

    def __init__(self, http: httpx.Client, name: str, timeout: float) -> None:
        self.http, self.name, self.timeout = http, name, timeout
        self.ids: list[int] = []
        created = http.post("/v1/runs", json={"name": name, "sampler": {"num_samples": 8}})
        assert created.status_code == 201, created.text

    def post(self, steps: int) -> None:
        for _ in range(steps):
            answer = self.http.post(f"/v1/runs/{self.name}/batches", json=scored_step(len(self.ids) + 1))
            answer.raise_for_status()
            self.ids.append(answer.json()["batch_id"])

    def _finished(self, i: int) -> bool:
        status = self.http.get(f"/v1/batches/{self.ids[i]}").json()["status"]
        if status == "failed":
            raise RuntimeError(f"batch {self.ids[i]} failed")
        return bool(status == "done")

    def done(self) -> int:
        """Steps done: the worker takes one run's steps in order, so they are a prefix (found by bisection)."""
        low, high = 0, len(self.ids)
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if self._finished(middle) else (low, middle)
        return low

    def wait(self, count: int) -> None:
        deadline = time.monotonic() + self.timeout
        while not self._finished(count - 1):
            if time.monotonic() > deadline:
                raise RuntimeError(f"step {count} of {self.name} not scored within {self.timeout} s")
            time.sleep(0.05)

    def queue(self, seconds: float, expected: float) -> None:
        """A backlog of about four times what ``expected`` steps per second would do in ``seconds`` (the warm-up's
        speed is a first step's, which understates a warm worker's)."""
        self.post(int(expected * seconds * 4) + 20)

    def rate(self, seconds: float) -> dict[str, Any]:
        """Scored steps per second over ``seconds``, from the backlog ``queue`` left."""
        load = os.getloadavg()[0]
        t0, k0 = time.monotonic(), self.done()
        time.sleep(seconds)
        k1, t1 = self.done(), time.monotonic()
        return {
            "steps_per_second": round((k1 - k0) / (t1 - t0), 3),
            "drained": k1 == len(self.ids),
            "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
        }


class Noise:
    """``trainers`` threads, each posting one batch a second (open loop) to a run of its own."""

    def __init__(self, base: str, kind: str, trainers: int, rate: float) -> None:
        self.base, self.kind, self.trainers, self.rate = base, kind, trainers, rate
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.errors = 0
        self.threads = [threading.Thread(target=self._trainer, args=(i,)) for i in range(trainers)]

    def _trainer(self, i: int) -> None:
        body = noise_body(self.kind, np.random.default_rng(i))
        run = f"noise-{self.kind}-{i}"
        path = f"/v1/runs/{run}/matrices" if self.kind == "matrices" else f"/v1/runs/{run}/batches"
        with httpx.Client(base_url=self.base, timeout=60) as http:
            created = http.post("/v1/runs", json={"name": run, "schedule": {"every": 1_000_000}})
            assert created.status_code in (200, 201), created.text
            step = 2  # off the schedule (step 1 is always scored)
            start = time.monotonic() + i / (self.trainers * self.rate)
            while not self.stop.is_set():
                wait = start + (step - 2) / self.rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                sent = time.perf_counter()
                response = http.post(path, content=body.replace(b'"step": 0', f'"step": {step}'.encode()), headers=JSON)
                if response.status_code in (201, 202):
                    self.latencies.append(time.perf_counter() - sent)
                else:
                    self.errors += 1
                step += 1

    def __enter__(self) -> Noise:
        for thread in self.threads:
            thread.start()
        time.sleep(2.0)  # every trainer has created its run and is at its pace
        self.latencies.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def measure(base: str, kind: str, trainers: int, rate: float, seconds: float, timeout: float) -> dict[str, Any]:
    with httpx.Client(base_url=base, timeout=60) as http:
        scored = ScoredRun(http, f"scored-{kind}", timeout)
        scored.post(3)  # warm-up: the scorer loaded, the first steps recorded
        scored.wait(3)
        started = time.monotonic()
        scored.post(5)
        scored.wait(8)
        expected = 5 / (time.monotonic() - started)
        scored.wait(len(scored.ids))
        scored.queue(seconds, expected)
        alone = scored.rate(seconds)
        scored.wait(len(scored.ids))  # the loaded phase starts from the same backlog as the alone one
        # Queued before the noise starts: under load the posts slow down, and a worker that drains them as they
        # come would be measured idle.
        scored.queue(seconds, expected)
        with Noise(base, kind, trainers, rate) as noise:
            started = time.monotonic()
            loaded = scored.rate(seconds)
            elapsed = time.monotonic() - started
        return {
            "noise": kind,
            "trainers": trainers,
            "batches_per_second_each": rate,
            "scored_steps_per_second_alone": alone["steps_per_second"],
            "scored_steps_per_second_loaded": loaded["steps_per_second"],
            "loaded_over_alone": round(loaded["steps_per_second"] / alone["steps_per_second"], 3),
            "backlog_drained": alone["drained"] or loaded["drained"],
            "load_average_alone": alone["load_average"],
            "load_average_loaded": loaded["load_average"],
            "noise_requests": len(noise.latencies),
            "noise_requests_per_second": round(len(noise.latencies) / elapsed, 1),
            "noise_errors": noise.errors,
            "noise_latency": percentiles(noise.latencies),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--scorer", default="tiny-random", help="tiny-random or smollm2-135m")
    parser.add_argument(
        "--worker",
        choices=("embedded", "process"),
        default="embedded",
        help="score in the server's thread, or in a collapse-monitor worker process (Postgres)",
    )
    parser.add_argument("--noise", default=",".join(NOISE_KINDS), help="comma-separated: off-schedule, matrices")
    parser.add_argument("--trainers", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.0, help="noise batches per second per trainer")
    parser.add_argument("--seconds", type=float, default=30, help="length of each phase")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a phase may take")
    args = parser.parse_args()
    if args.worker == "process" and "sqlite" in args.backends.split(","):
        parser.error("--worker process needs Postgres (--backends postgres): a worker process cannot share SQLite")
    # A fresh service per (backend, noise): the worker would still be working off the last noise's batches.
    for backend in args.backends.split(","):
        for kind in args.noise.split(","):
            with tempfile.TemporaryDirectory() as tmp, database(backend, tmp) as url:
                settings = {
                    "DATABASE_URL": url,
                    "DATA_DIR": tmp,
                    "EMBEDDED_WORKER": str(args.worker == "embedded").lower(),
                    "DEFAULT_SCORER": args.scorer,
                    "MAX_QUEUE_DEPTH": "1000000",
                    "MAX_QUEUED_PER_RUN": "1000000",
                    "RATE_LIMIT_PER_SECOND": "0",
                }
                with (
                    served(settings, ready_seconds=600) as base,
                    worker_process(settings) if args.worker == "process" else nullcontext(),
                ):
                    result = measure(base, kind, args.trainers, args.rate, args.seconds, args.timeout)
                print(
                    json.dumps({"backend": backend, "scorer": args.scorer, "worker": args.worker, **result}), flush=True
                )


if __name__ == "__main__":
    main()
