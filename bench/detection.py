"""Detection: how fast the TemplateCollapse rule fires on runs that collapse, and whether it cries wolf.

    python bench/detection.py [--runs 20] [--steps 40] [--seed 0]
    python bench/detection.py --source corpus [--rows 16,32,64] [--half evaluation] [--healthy-runs 50]

``--source corpus`` replays runs from the SmolLM2 trace corpus (bench/corpus/simulate.py: healthy,
sharp, gradual, partial and mixture stories) through the same endpoint, with token entropies and
rewards, on the evaluation half of its prompts, and reports the issue-12 targets per batch size.
The default, synthetic source:

Simulated runs are fed through the real ingest path (POST /v1/runs/{run}/matrices on the real app
with its SQLite storage and alert engine). Every row's own prompt scores about -2 nats per token,
so H(Z|X) stays near 2 throughout (with noise and a slow drift, as in training); the other prompts
score ``dependence`` nats lower. Healthy runs keep a noisy dependence around 1 nat; collapsing runs
lose it from a known onset step (drawn in [12, 24]): "sharp" keeps 30% of it at the onset step and
10% after; "gradual" declines over four steps (70%, 50%, 30%, 10%), its onset being the first step
of the decline. Compared with an entropy-only rule (EntropyCollapse: H(Z|X) below half its
baseline), which is what entropy monitoring amounts to. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient

from bench.corpus.simulate import CORPUS
from service.app import create_app
from service.settings import Settings


def matrix(step: int, dependence: float, entropy: float, rng: np.random.Generator) -> dict:
    n_columns, per_column = 6, 4
    rows = n_columns * per_column
    lengths = rng.integers(20, 60, rows)
    own = np.repeat(np.arange(n_columns), per_column)
    # Per-row and per-cell noise: prompts are not equally easy, rows not equally long.
    per_token = (
        -entropy
        - dependence * (np.arange(n_columns)[None, :] != own[:, None])
        + rng.normal(0, 0.25, (rows, 1))
        + rng.normal(0, 0.15, (rows, n_columns))
    )
    return {
        "step": step,
        "row_group_ids": own.tolist(),
        "reasoning_lengths": lengths.tolist(),
        "L_seq": (per_token * lengths[:, None]).tolist(),
    }


PROFILES = {"sharp": (0.3, 0.1), "gradual": (0.7, 0.5, 0.3, 0.1)}


def simulate(
    client: TestClient,
    name: str,
    steps: int,
    onset: int | None,
    profile: tuple[float, ...],
    rng: np.random.Generator,
    alerts: dict[str, object] | None = None,
) -> None:
    assert client.post("/v1/runs", json={"name": name, "alerts": alerts or {}}).status_code == 201
    base_dependence = rng.uniform(0.7, 1.3)
    for step in range(1, steps + 1):
        entropy = 2.0 - 0.004 * step + rng.normal(0, 0.03)  # slow drift, no collapse
        dependence = base_dependence + rng.normal(0, 0.12)
        if onset is not None and step >= onset:
            dependence *= profile[min(step - onset, len(profile) - 1)] + rng.normal(0, 0.03)
        response = client.post(f"/v1/runs/{name}/matrices", json=matrix(step, dependence, entropy, rng))
        assert response.status_code == 201, response.text


def first_fire(client: TestClient, name: str, rule: str) -> int | None:
    alerts = client.get(f"/v1/runs/{name}/alerts", params={"rule": rule}).json()
    fired = [a["fired_step"] for a in alerts if a["fired_step"] is not None]
    return min(fired) if fired else None


def report(delays: list[int | None], false_alarms: int, healthy: int) -> dict[str, object]:
    found = [d for d in delays if d is not None]
    return {
        "detected": f"{len(found)}/{len(delays)}",
        "delay_steps_mean": round(statistics.mean(found), 2) if found else None,
        "delay_steps_max": max(found) if found else None,
        "false_alarms": f"{false_alarms}/{healthy} healthy runs (plus alarms before onset)",
    }


def corpus_runs(client: TestClient, rows: int, args: argparse.Namespace) -> dict[str, object]:
    """Replays corpus runs of one batch size through POST /v1/runs/{run}/matrices; the target table."""
    from bench.corpus.calibrate import TARGET_DELAY, Replay, delay
    from bench.corpus.simulate import KINDS, Run, halves, load, story

    corpus = load(args.corpus)
    prompts = halves(corpus.n_prompts)[args.half]
    rng = np.random.default_rng([args.seed, rows])
    kinds: dict[str, list[tuple[str, Replay, list[int]]]] = {}
    for kind in KINDS:
        kinds[kind] = []
        for i in range(args.healthy_runs if kind == "healthy" else args.runs):
            s = story(kind, prompts, None if kind == "healthy" else int(rng.integers(12, 25)), rng)
            run = Run(corpus, prompts, rows, s, seed=int(rng.integers(2**31)))
            name = f"{kind}-{rows}-{i}"
            assert client.post("/v1/runs", json={"name": name}).status_code == 201
            lost: list[int] = []
            for step in range(1, args.steps + 1):
                body = {"step": step, **run.step(step)}
                response = client.post(f"/v1/runs/{name}/matrices", json=body)
                assert response.status_code == 201, response.text
                lost = response.json()["results"]["samplers"]["matrix"]["lost_group_ids"]
            kinds[kind].append((name, Replay(s, {}, lost), lost))
    table: dict[str, object] = {"rows": rows, "prompts": list(prompts)}
    for label, rule in (("template_collapse_rule", "TemplateCollapse"), ("entropy_only_rule", "EntropyCollapse")):
        out: dict[str, object] = {}
        for kind, runs in kinds.items():
            fires = [first_fire(client, name, rule) for name, _, _ in runs]
            if kind == "healthy":
                out[kind] = {"false_alarms": f"{sum(f is not None for f in fires)}/{len(runs)}"}
                continue
            delays = [delay(r, f) for (_, r, _), f in zip(runs, fires, strict=True)]
            found = [d for d in delays if d is not None]
            early = sum(
                f is not None and r.story.onset is not None and f < r.story.onset
                for (_, r, _), f in zip(runs, fires, strict=True)
            )
            out[kind] = {
                "detected": f"{len(found)}/{len(runs)}",
                f"within_{TARGET_DELAY}_steps": f"{sum(d <= TARGET_DELAY for d in found)}/{len(runs)}",
                "delay_steps_mean": round(statistics.mean(found), 2) if found else None,
                "delay_steps_max": max(found) if found else None,
                "alarms_before_onset": early,
            }
            if kind == "partial" and rule == "TemplateCollapse":
                named = 0
                for name, r, _ in runs:
                    alerts = client.get(f"/v1/runs/{name}/alerts", params={"rule": rule}).json()
                    summary = " ".join(a["summary"] for a in alerts if a["fired_step"] is not None)
                    expected = f"lost input dependence: {', '.join(map(str, r.story.collapsed))}"
                    named += expected in summary
                out[kind]["named_in_alert"] = f"{named}/{len(runs)}"
                out[kind]["named_in_last_batch"] = (
                    f"{sum(lost == list(r.story.collapsed) for _, r, lost in runs)}/{len(runs)}"
                )
        table[label] = out
    return table


def corpus_main(args: argparse.Namespace) -> None:
    for key in [k for k in os.environ if k.startswith("COLLAPSE_MONITOR_")]:
        del os.environ[key]
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(_env_file=None, data_dir=Path(tmp), scoring_paused=True)  # type: ignore[call-arg]
        with TestClient(create_app(settings), base_url="http://localhost") as client:  # a host it answers to
            for rows in [int(v) for v in args.rows.split(",")]:
                tables.append(corpus_runs(client, rows, args))
    print(
        json.dumps(
            {
                "source": "corpus",
                "half": args.half,
                "runs_per_kind": args.runs,
                "healthy_runs": args.healthy_runs,
                "steps": args.steps,
                "seed": args.seed,
                "tables": tables,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("synthetic", "corpus"), default="synthetic")
    parser.add_argument("--runs", type=int, default=20, help="healthy runs and collapsing runs, each")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drop-fraction", type=float, help="override the rule's default drop_fraction")
    parser.add_argument("--rows", default="16,32,64", help="corpus: batch sizes (rows per step)")
    parser.add_argument("--half", choices=("evaluation", "calibration"), default="evaluation", help="corpus")
    parser.add_argument("--healthy-runs", type=int, default=50, help="corpus: healthy runs per batch size")
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="corpus: the corpus file")
    args = parser.parse_args()
    if args.source == "corpus":
        corpus_main(args)
        return
    alerts = {} if args.drop_fraction is None else {"drop_fraction": args.drop_fraction}
    rng = np.random.default_rng(args.seed)
    for key in [k for k in os.environ if k.startswith("COLLAPSE_MONITOR_")]:
        del os.environ[key]
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(_env_file=None, data_dir=Path(tmp), scoring_paused=True)  # type: ignore[call-arg]
        with TestClient(create_app(settings), base_url="http://localhost") as client:  # a host it answers to
            onsets = [int(rng.integers(12, 25)) for _ in range(args.runs)]
            for i in range(args.runs):
                simulate(client, f"healthy-{i}", args.steps, None, (), rng, alerts)
                for profile, shape in PROFILES.items():
                    simulate(client, f"{profile}-{i}", args.steps, onsets[i], shape, rng, alerts)
            results: dict[str, dict[str, dict[str, object]]] = {}
            for label, rule in (
                ("template_collapse_rule", "TemplateCollapse"),
                ("entropy_only_rule", "EntropyCollapse"),
            ):
                false_alarms = sum(first_fire(client, f"healthy-{i}", rule) is not None for i in range(args.runs))
                results[label] = {}
                for profile in PROFILES:
                    fires = [first_fire(client, f"{profile}-{i}", rule) for i in range(args.runs)]
                    early = sum(f is not None and f < onset for f, onset in zip(fires, onsets, strict=True))
                    delays = [
                        None if f is None or f < onset else f - onset + 1
                        for f, onset in zip(fires, onsets, strict=True)
                    ]
                    results[label][profile] = report(delays, false_alarms + early, args.runs)
    print(json.dumps({"runs_per_kind": args.runs, "steps": args.steps, "seed": args.seed, "alerts": alerts, **results}))


if __name__ == "__main__":
    main()
