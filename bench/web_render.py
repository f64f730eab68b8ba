"""How fast the web pages render in a real browser: a long run's page, and the runs page with many runs.

    python bench/web_render.py [--steps 10000] [--runs 200] [--loads 5] [--backend sqlite|postgres]

Seeds a database directly (no scoring: this measures reading and drawing): one run with
``--steps`` scored steps and 20 stored series (the run page draws 13 of them) plus an alert
episode and the newest step's cross-scoring matrix, and ``--runs`` runs of 100 steps each for
the runs page. Starts ``collapse-monitor serve`` on it and loads each page ``--loads`` times in
Debian's headless Chromium (one cold load, then reloads with the static files cached), timing
navigation start to the page's own "rendered" mark (charts, alerts and heatmap drawn; every
row with its sparklines). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import create_engine, insert

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving import database, served

from service.storage.database import migrate
from service.storage.tables import Alert, Batch, LatestMetric, MetricPoint, Run, ScoreMatrix, utcnow
from tests.e2e.browser import chromium_missing, launched

SAMPLER_SERIES = (
    "mi_estimate",
    "mi_estimate_ci_low",
    "mi_estimate_ci_high",
    "retrieval_accuracy",
    "retrieval_accuracy_ci_low",
    "retrieval_accuracy_ci_high",
    "retrieval_chance_level",
    "retrieval_above_chance",
    "conditional_entropy_est",
    "reasoning_entropy_est",
    "token_entropy_mean",
    "mi_zscore_ema",
    "mi_seq_estimate",
    "rows",
    "columns",
)
BATCH_SERIES = (
    "rollout/in_group_reward_std",
    "zero_variance_group_ratio",
    "reward_mean",
    "trainer_token_entropy_mean",
    "valid_thinking_rate",
)


def seed_run(connection, name: str, steps: int, rng: np.random.Generator) -> int:
    run_id = connection.execute(
        insert(Run).returning(Run.id),
        {
            "name": name,
            "project": "bench",
            "details": {"model": "Qwen2.5-3B", "algorithm": "PPO", "environment": "Sokoban", "tags": []},
            "scorer": "tiny-random",
            "scorer_mode": "reference",
            "score_every": 1,
            "samplers": ["first_turn"],
            "num_samples": 64,
            "seed": 0,
            "temperature": 1.0,
            "filter": {},
            "alert_rules": {},
            "created_at": utcnow(),
        },
    ).scalar_one()
    now = utcnow()
    batch_ids = [uuid.uuid4().hex for _ in range(steps)]
    connection.execute(
        insert(Batch),
        [
            {
                "id": batch_ids[s],
                "run_id": run_id,
                "step": s + 1,
                "idempotency_key": None,
                "kind": "matrix",
                "payload": "{}",
                "payload_sha256": "0" * 64,
                "status": "done",
                "attempts": 0,
                "created_at": now,
                "result": {},
            }
            for s in range(steps)
        ],
    )
    decay = np.clip(np.linspace(1.5, -0.5, steps), 0, 1)  # input dependence falls in the second half
    rows, latest = [], []
    for sampler, names in (("first_turn", SAMPLER_SERIES), ("all", BATCH_SERIES)):
        for k, metric in enumerate(names):
            values = decay * (1 + 0.1 * k) + rng.normal(0, 0.02, steps)
            rows += [
                {
                    "run_id": run_id,
                    "batch_id": batch_ids[s],
                    "step": s + 1,
                    "sampler": sampler,
                    "name": metric,
                    "value": float(values[s]),
                    "created_at": now,
                }
                for s in range(steps)
            ]
            latest.append(
                {"run_id": run_id, "sampler": sampler, "name": metric, "step": steps, "value": float(values[-1])}
            )
    for start in range(0, len(rows), 20_000):
        connection.execute(insert(MetricPoint), rows[start : start + 20_000])
    connection.execute(insert(LatestMetric), latest)
    n_rows, n_columns = 64, 8
    connection.execute(
        insert(ScoreMatrix),
        {
            "batch_id": batch_ids[-1],
            "sampler": "first_turn",
            "run_id": run_id,
            "step": steps,
            "n_rows": n_rows,
            "n_columns": n_columns,
            "l_tok": rng.normal(-2, 0.3, (n_rows, n_columns)).astype("<f4").tobytes(),
            "column_of_row": [r % n_columns for r in range(n_rows)],
            "column_labels": list(range(n_columns)),
            "row_sources": None,
            "created_at": now,
        },
    )
    onset = steps // 2
    connection.execute(
        insert(Alert),
        {
            "run_id": run_id,
            "sampler": "first_turn",
            "rule": "TemplateCollapse",
            "severity": "critical",
            "state": "firing",
            "onset_step": onset,
            "fired_step": onset + 3,
            "last_step": steps,
            "summary": "seeded for the benchmark",
            "description": "",
        },
    )
    return int(run_id)


def seed(url: str, steps: int, runs: int) -> None:
    migrate(url)
    rng = np.random.default_rng(0)
    engine = create_engine(url)
    with engine.begin() as connection:
        seed_run(connection, "long-run", steps, rng)
        for r in range(runs):
            seed_run(connection, f"run-{r:03d}", 100, rng)
    engine.dispose()


# Of the time to the rendered mark, how long at least one API request was in flight (union of intervals).
API_WAIT = """() => {
  const end = window.collapseMonitor.renderedAt;
  const spans = performance.getEntriesByType('resource').filter(e => e.name.includes('/v1/') && e.startTime < end)
    .map(e => [e.startTime, e.responseEnd]).sort((a, b) => a[0] - b[0]);
  let total = 0, from = -1, to = -1;
  for (const [s, e] of spans) { if (s > to) { total += to - from; from = s; to = e; } else to = Math.max(to, e); }
  return total + to - from;
}"""


def timed_loads(browser, url: str, loads: int, ready: str) -> list[tuple[float, float]]:
    """(ms from navigation start to the page's rendered mark, ms of it waiting on the API) per load, first cold."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    out = []
    try:
        for _ in range(loads):
            page.goto(url)
            page.wait_for_function("() => window.collapseMonitor && window.collapseMonitor.renderedAt", timeout=60_000)
            page.wait_for_selector(ready)
            out.append(
                (float(page.evaluate("() => window.collapseMonitor.renderedAt")), float(page.evaluate(API_WAIT)))
            )
    finally:
        page.close()
    if errors:
        raise RuntimeError(f"{url}: {errors}")
    return out


def summary(loads: list[tuple[float, float]]) -> dict:
    later = loads[1:] or loads
    return {
        "first_load_ms": round(loads[0][0]),
        "reload_median_ms": round(statistics.median(total for total, _ in later)),
        "reload_median_api_wait_ms": round(statistics.median(api for _, api in later)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    args = parser.parse_args()
    missing = chromium_missing()
    if missing:
        raise SystemExit(missing)
    with tempfile.TemporaryDirectory() as tmp, database(args.backend, tmp) as url:
        started = time.perf_counter()
        seed(url, args.steps, args.runs)
        seed_seconds = time.perf_counter() - started
        result = measure(url, tmp, args)
        result["seed_seconds"] = round(seed_seconds, 1)
    print(json.dumps(result, indent=2))


def measure(url: str, tmp: str, args: argparse.Namespace) -> dict:
    settings = {
        "DATABASE_URL": url,
        "DATA_DIR": f"{tmp}/data",
        "SCORING_PAUSED": "true",
        "DEFAULT_SCORER": "tiny-random",
    }
    with served(settings) as base:
        with launched() as browser:
            run_ms = timed_loads(browser, f"{base}/runs/long-run", args.loads, "svg.heatmap rect.cell")
            runs_ms = timed_loads(browser, f"{base}/", args.loads, "#runs tbody tr")
        series = httpx.get(
            f"{base}/v1/runs/long-run/metrics", params={"format": "columns", "limit": 1_000_000}, timeout=60
        ).json()
        overview = httpx.get(f"{base}/v1/overview", timeout=60).json()
    return {
        "backend": args.backend,
        "load_average_1min": round(os.getloadavg()[0], 1),
        "run_page": {"steps": args.steps, "stored_series": len(series["series"]), **summary(run_ms)},
        "runs_page": {"runs": len(overview["runs"]), **summary(runs_ms)},
    }


if __name__ == "__main__":
    main()
