"""Chooses TemplateCollapse's signal and defaults on the calibration half of the corpus prompts.

    python -m bench.corpus.calibrate [--rows 16,32,64] [--healthy-runs 50] [--runs 20] [--steps 40]

Runs are replayed through the service's own code without a database: ``service.ingest.matrices.score_matrix``
(what ``POST /v1/runs/{run}/matrices`` computes) gives each step's points, and
``service.alerts.rules.evaluate`` (what the alert engine runs after each step) replays the history
under each candidate setting. A candidate is admissible when it raises no alarm in any healthy run
and none before the onset, at every batch size; among those, the one that detects the most
collapses within the target delay (3 scored steps) wins, then the smallest mean delay. Prints one
JSON object: the best setting per signal and the chosen one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.corpus.simulate import CORPUS, KINDS, Corpus, Run, Story, halves, load, story
from scoring.estimators import EmaState
from service.alerts.rules import Series, evaluate
from service.alerts.rules.template import TemplateCollapse
from service.ingest.matrices import score_matrix
from service.schemas.alerts import AlertSettings, Signal
from service.schemas.inputs import MatrixBatchIn

SAMPLER = "matrix"
TARGET_DELAY = 3


@dataclass(frozen=True)
class Replay:
    story: Story
    series: Series
    lost_last: list[int]


def replay(run: Run, steps: int) -> Replay:
    """A run's stored series (sampler ``matrix``) as the matrices endpoint would write them."""
    ema = EmaState()
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    lost: list[int] = []
    for step in range(1, steps + 1):
        scored = score_matrix(MatrixBatchIn(step=step, **run.step(step)), ema, {})
        ema = scored.ema.get(SAMPLER, ema)
        for point in scored.points:
            if point.sampler == SAMPLER:
                series[point.name].append((step, point.value))
        lost = (scored.result.samplers or {})[SAMPLER].lost_group_ids
    return Replay(run.story, dict(series), lost)


def replays(
    corpus: Corpus, half: str, rows: int, runs: int, healthy_runs: int, steps: int, seed: int
) -> dict[str, list[Replay]]:
    prompts = halves(corpus.n_prompts)[half]
    rng = np.random.default_rng([seed, rows])
    out: dict[str, list[Replay]] = {}
    for kind in KINDS:
        n = healthy_runs if kind == "healthy" else runs
        out[kind] = []
        for _ in range(n):
            onset = None if kind == "healthy" else int(rng.integers(12, 25))
            s = story(kind, prompts, onset, rng)
            out[kind].append(replay(Run(corpus, prompts, rows, s, seed=int(rng.integers(2**31))), steps))
    return out


def first_fire(r: Replay, config: AlertSettings, rule: str = TemplateCollapse.name) -> int | None:
    fired = [e.fired_step for e in evaluate("sim", SAMPLER, r.series, config) if e.rule == rule and e.fired_step]
    return min(fired) if fired else None


def delay(r: Replay, fired: int | None) -> int | None:
    """Scored steps from the story's reference step (onset; 50% share for gradual) to the alert, 1 = same step."""
    reference = r.story.half_step()
    if fired is None or reference is None or r.story.onset is None or fired < r.story.onset:
        return None
    return fired - reference + 1


def outcome(runs: dict[str, list[Replay]], config: AlertSettings, rule: str = TemplateCollapse.name) -> dict[str, Any]:
    """Per kind: detections, delays, alarms in healthy runs and before onsets."""
    result: dict[str, Any] = {}
    for kind, rs in runs.items():
        fires = [first_fire(r, config, rule) for r in rs]
        if kind == "healthy":
            result[kind] = {"false_alarms": sum(f is not None for f in fires), "runs": len(rs)}
            continue
        early = sum(
            f is not None and r.story.onset is not None and f < r.story.onset for f, r in zip(fires, rs, strict=True)
        )
        delays = [delay(r, f) for r, f in zip(rs, fires, strict=True)]
        found = [d for d in delays if d is not None]
        result[kind] = {
            "detected": len(found),
            "within_target": sum(d <= TARGET_DELAY for d in found),
            "runs": len(rs),
            "early_alarms": early,
            "delay_mean": round(statistics.mean(found), 2) if found else None,
            "delay_max": max(found) if found else None,
        }
    return result


def candidates() -> list[AlertSettings]:
    out = []
    signals: tuple[Signal, ...] = ("mi_zscore_ema", "mi_estimate", "retrieval_above_chance")
    for signal, drop, window, intervals in itertools.product(signals, (0.2, 0.3, 0.4, 0.5), (1, 2, 3), (True, False)):
        out.append(AlertSettings(signal=signal, drop_fraction=drop, window=window, use_intervals=intervals))
    for drop, h, window in itertools.product((0.25, 0.4), (3.0, 4.0, 6.0, 8.0, 12.0), (1, 2, 3)):
        out.append(AlertSettings(signal="mi_cusum", cusum_drop=drop, cusum_threshold=h, window=window))
    return out


def merit(outcomes: list[dict[str, Any]], config: AlertSettings) -> tuple[bool, int, float, float]:
    """(admissible, collapses detected within the target, -mean delay rounded to a step, robustness).

    Among settings equally good to the step, the most conservative wins (highest CUSUM threshold or
    smallest drop, longest window), so the choice does not sit on the edge of a false alarm.
    """
    admissible = all(
        o["healthy"]["false_alarms"] == 0 and all(o[k]["early_alarms"] == 0 for k in o if k != "healthy")
        for o in outcomes
    )
    within = sum(o[k]["within_target"] for o in outcomes for k in o if k != "healthy")
    delays = [o[k]["delay_mean"] for o in outcomes for k in o if k != "healthy" and o[k]["delay_mean"] is not None]
    delay = round(statistics.mean(delays)) if delays else 99
    robust = config.cusum_threshold if config.signal == "mi_cusum" else 1 - config.drop_fraction
    return admissible, within, -delay, robust * 10 + config.window


def changed(config: AlertSettings) -> dict[str, Any]:
    default = AlertSettings()
    return {k: v for k, v in config.model_dump().items() if v != getattr(default, k) or k == "signal"}


def replay_parameters(args: argparse.Namespace) -> dict[str, int]:
    """What ``replays`` takes from the command line; both reports give it."""
    return {"runs": args.runs, "healthy_runs": args.healthy_runs, "steps": args.steps, "seed": args.seed}


def evaluate_defaults(corpus: Corpus, sizes: list[int], args: argparse.Namespace) -> None:
    tables = []
    for n in sizes:
        data = replays(corpus, "evaluation", n, **replay_parameters(args))
        table: dict[str, Any] = {"rows": n}
        for label, rule in (
            ("template_collapse_rule", TemplateCollapse.name),
            ("entropy_only_rule", "EntropyCollapse"),
        ):
            table[label] = outcome(data, AlertSettings(), rule)
        partial = data["partial"]
        table["template_collapse_rule"]["partial"]["named_in_last_batch"] = sum(
            r.lost_last == list(r.story.collapsed) for r in partial
        )
        tables.append(table)
    print(
        json.dumps(
            {
                "half": "evaluation",
                "path": "service.ingest.matrices.score_matrix + service.alerts.rules.evaluate (no database)",
                "settings": changed(AlertSettings()),
                **replay_parameters(args),
                "tables": tables,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--healthy-runs", type=int, default=50)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument(
        "--evaluate",
        action="store_true",
        help="report the default settings on the evaluation half instead (the same tables as bench/detection.py "
        "--source corpus, without the database)",
    )
    args = parser.parse_args()
    corpus = load(args.corpus)
    sizes = [int(v) for v in args.rows.split(",")]
    if args.evaluate:
        evaluate_defaults(corpus, sizes, args)
        return
    data = {n: replays(corpus, "calibration", n, **replay_parameters(args)) for n in sizes}
    best: dict[str, tuple[tuple[bool, int, float, float], AlertSettings, list[dict[str, Any]]]] = {}
    for config in candidates():
        outcomes = [outcome(data[n], config) for n in sizes]
        m = merit(outcomes, config)
        if config.signal not in best or m > best[config.signal][0]:
            best[config.signal] = (m, config, outcomes)
    chosen = max(best.values(), key=lambda b: b[0])
    print(
        json.dumps(
            {
                "half": "calibration",
                "rows": sizes,
                **replay_parameters(args),
                "best_per_signal": {
                    signal: {
                        "admissible": m[0],
                        "within_target": m[1],
                        "delay_mean_rounded": -m[2],
                        "settings": changed(config),
                        "by_rows": dict(zip(map(str, sizes), outcomes, strict=True)),
                    }
                    for signal, (m, config, outcomes) in best.items()
                },
                "chosen": changed(chosen[1]),
            }
        )
    )


if __name__ == "__main__":
    main()
