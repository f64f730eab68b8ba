"""Claiming: how long one claim takes with many runs queued, and how long a light run waits.

    python bench/claims.py [--runs 200] [--per-run 20] [--claims 200] [--backends sqlite,postgres] [--tokens]

Fills a throwaway database with ``--runs`` heavy runs of ``--per-run`` queued batches each (rows
written directly; nothing is scored), then posts one batch of a light run, and times
``claim_batch`` + ``finish_batch`` transactions, one after the other. Reports the median and p99
milliseconds per claim and at which claim the light run's batch was taken: with round-robin
claiming ``--runs`` + 1 (each heavy run, never served either, has one turn first, then the light
run goes before any heavy run's second turn); oldest-batch-first would make it runs x per-run + 1.
With ``--tokens`` the heavy runs were all created by one ingest token and the light run by
another: claims take turns across tokens first, so the light run's batch is taken at claim 2.
Prints one JSON object per backend.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from datetime import timedelta

import numpy as np
from serving import database
from sqlalchemy import insert, text

from service.storage import queue
from service.storage.database import make_engine, make_sessions, migrate
from service.storage.tables import Batch, Run, utcnow


def fill(url: str, runs: int, per_run: int, tokens: bool = False) -> str:
    """Queues the heavy runs' batches (oldest first), then the light run's one; returns its id.

    ``tokens``: the heavy runs were created by token 1, the light run by token 2 (else by none).
    """
    engine = make_engine(url)
    start = utcnow() - timedelta(hours=1)
    with engine.begin() as connection:
        connection.execute(
            insert(Run),
            [
                {
                    "name": f"run-{r}",
                    "scorer": "tiny-random",
                    "scorer_mode": "reference",
                    "samplers": ["first_turn"],
                    "created_by_token": (2 if r == runs else 1) if tokens else None,
                }
                for r in range(runs + 1)
            ],
        )
        ids = {name: i for i, name in connection.execute(text("SELECT id, name FROM runs")).all()}
        rows = [
            {
                "id": uuid.uuid4().hex,
                "run_id": ids[f"run-{r}"],
                "step": s,
                "kind": "rollouts",
                "payload": "{}",
                "payload_sha256": uuid.uuid4().hex,
                "status": "queued",
                "attempts": 0,
                "created_at": start + timedelta(milliseconds=s * runs + r),
            }
            for r in range(runs)
            for s in range(per_run)
        ]
        light = uuid.uuid4().hex
        rows.append(rows[0] | {"id": light, "run_id": ids[f"run-{runs}"], "step": 0, "created_at": utcnow()})
        connection.execute(insert(Batch), rows)
    engine.dispose()
    return light


def measure(url: str, runs: int, per_run: int, claims: int, tokens: bool = False) -> dict[str, object]:
    migrate(url)
    light = fill(url, runs, per_run, tokens)
    engine = make_engine(url)
    sessions = make_sessions(engine)
    seconds, light_after = [], None
    for n in range(claims):
        began = time.perf_counter()
        with sessions.begin() as session:
            batch = queue.claim_batch(session, "bench#0", 60, max_attempts=3)
            assert batch is not None
            queue.finish_batch(session, batch.id, "bench#0", status="done")
            claimed = batch.id
        seconds.append(time.perf_counter() - began)
        if claimed == light:
            light_after = n + 1
    engine.dispose()
    ms = np.array(seconds) * 1000
    return {
        "runs": runs,
        "tokens": tokens,
        "queued": runs * per_run + 1,
        "claims": claims,
        "claim_ms_p50": round(float(np.median(ms)), 2),
        "claim_ms_p99": round(float(np.percentile(ms, 99)), 2),
        "light_run_claimed_at_claim": light_after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--per-run", type=int, default=20)
    parser.add_argument("--claims", type=int, default=300)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--tokens", action="store_true", help="heavy runs of one token, the light run of another")
    args = parser.parse_args()
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as tmp, database(backend, tmp) as url:
            result = measure(url, args.runs, args.per_run, args.claims, args.tokens)
            print(json.dumps({"backend": backend, **result}), flush=True)


if __name__ == "__main__":
    main()
