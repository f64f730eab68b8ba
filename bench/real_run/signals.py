"""Which signal sees template collapse on real training, and when: the zoo's table (issue 27).

    python -m bench.real_run.signals [--out bench/real_run/zoo/signals.json]

Reads the zoo (``bench.real_run.zoo``: each arm's recorded steps and the service's scoring of them)
and judges every TemplateCollapse signal against an independent, words-only ground truth:

* **Ground truth, crossing and labels** as ``bench.real_run.protocol`` defines them (docs/evaluation.md):
  word retrieval above chance per step; the level is the mean over every step of the family's healthy
  controls; an arm crossed at the first step from 2 on where the truth is below half the level for 3
  steps (to the end, at least 2, where it ends first); a crossed arm whose policy entropy (TRL's
  ``entropy``) more than tripled by the crossing blew up, and TemplateCollapse, which watches input
  dependence fall *while entropy does not*, is judged on the other collapses (``template``) only.
* **Signals**: each candidate is the service's own rule (``service.alerts.rules.evaluate``) on the
  arm's stored series, with the run defaults but for the signal (and the variants named in
  ``CANDIDATES``); head budgets other than the service's are computed from the stored head sums with
  the service's formulas (``scoring.dependence``).
* **Per signal**: detections (fired on a collapsed arm), the delay of each (fired step - crossing
  step; negative: before the ground truth crossed; "within 2 steps" is a delay from -2 to 2, and a firing
  more than 2 steps ahead, while the words still read the prompt, is an early alarm and counted apart),
  false alarms (fired on a healthy arm), and the
  Spearman correlation of the signal's series with task success and with the ground truth, per arm
  (their mean) and pooled over every arm's steps (the paper's table, at this scale).
* **Prompts per step** (item 2): the same rules on the matrices restricted to the first 2, 3, 4 and 6 of
  the 8 prompts of every step, to see what a smaller scored batch can still detect.

Prints the table as JSON and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.real_run import protocol, tasks, zoo
from scoring.config import CACHE_DIR
from scoring.dependence import DependenceConfig, dependence_signals, head_per_token, nearest_log_ratio
from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, per_token
from service.alerts.rules import evaluate
from service.schemas.alerts import AlertSettings

GROUND_TRUTH = "word_retrieval_above_chance"
EARLY = protocol.WITHIN  # a firing more than this many steps before the crossing is an early alarm
SERVICE_HEAD = 32  # the head budget the zoo's service computed (Settings.head_tokens when it scored)
PROMPT_SUBSETS = (2, 3, 4, 6)  # the first n of the 8 prompts of every step: what a smaller scored batch sees
# (label, AlertSettings fields, which series: "service" as stored, or "head@k" with the head budget k)
CANDIDATES: list[tuple[str, dict[str, Any], str]] = [
    ("retrieval_chance_corrected, baseline 3 (the default)", {}, "service"),
    (
        "retrieval_above_chance, baseline 5 (the previous default)",
        {"signal": "retrieval_above_chance", "baseline_steps": 5},
        "service",
    ),
    (
        "retrieval_chance_corrected, baseline 5",
        {"signal": "retrieval_chance_corrected", "baseline_steps": 5},
        "service",
    ),
    ("retrieval_chance_corrected, window 1", {"window": 1}, "service"),
    ("retrieval_chance_corrected, window 3", {"window": 3}, "service"),
    ("retrieval_mrr", {"signal": "retrieval_mrr"}, "service"),
    ("nearest_log_ratio", {"signal": "nearest_log_ratio"}, "service"),
    ("mi_seq_normalized", {"signal": "mi_seq_normalized"}, "service"),
    ("mi_estimate", {"signal": "mi_estimate"}, "service"),
    ("mi_estimate, baseline 5", {"signal": "mi_estimate", "baseline_steps": 5}, "service"),
    ("mi_excess", {"signal": "mi_excess"}, "service"),
    ("mi_zscore_ema", {"signal": "mi_zscore_ema"}, "service"),
    ("mi_cusum", {"signal": "mi_cusum"}, "service"),
    ("mi_cusum, baseline 5", {"signal": "mi_cusum", "baseline_steps": 5}, "service"),
    ("mi_head_estimate k=8", {"signal": "mi_head_estimate"}, "head@8"),
    ("mi_head_estimate k=16", {"signal": "mi_head_estimate"}, "head@16"),
    ("mi_head_estimate k=32", {"signal": "mi_head_estimate"}, "head@32"),
    ("mi_head_excess k=8", {"signal": "mi_head_excess"}, "head@8"),
    ("mi_head_excess k=16", {"signal": "mi_head_excess"}, "head@16"),
    ("mi_head_excess k=32", {"signal": "mi_head_excess"}, "head@32"),
]
CORRELATED = (  # series whose Spearman with task success and the ground truth is reported
    "mi_estimate",
    "mi_seq_estimate",
    "mi_zscore",
    "mi_zscore_ema",
    "retrieval_accuracy",
    "retrieval_above_chance",
    "retrieval_chance_corrected",
    "retrieval_mrr",
    "mi_seq_normalized",
    "mi_excess",
    "mi_head_estimate",
    "mi_head_excess",
    "conditional_entropy_est",
    "reasoning_entropy_est",
    "token_entropy_mean",
)


def column_prompts(record: list[dict[str, Any]]) -> list[list[list[int]]]:
    """Per recorded step, its columns' prompts as the scorer's token ids (columns in the order their questions
    first appear, as ``zoo.batch_of`` numbers the groups)."""
    tokenizer = _tokenizer()
    out = []
    for step in record:
        firsts = dict.fromkeys(zip(step["batch"]["questions"], step["batch"]["prompts"], strict=True))
        out.append([list(tokenizer.encode(prompt, add_special_tokens=False)) for _, prompt in firsts])
    return out


@functools.cache
def _tokenizer() -> Any:
    from scoring.models import load_tokenizer

    return load_tokenizer("smollm2-135m", CACHE_DIR)


def family_level(family: str) -> float:
    """The ground truth's level (``protocol.family_level``) over the zoo's healthy controls of ``family``."""
    controls = [arm for arm in tasks.ZOO if protocol.is_healthy_control(arm, family)]
    return protocol.family_level([[s[GROUND_TRUTH] for s in zoo.read_record(arm)] for arm in controls])


def step_series(
    scored: list[dict[str, Any]], source: str, columns: int | None = None, prompts: list[Any] | None = None
) -> dict[str, list[tuple[int, float]]]:
    """An arm's first_turn series as the rules read them: as stored, or recomputed (another head budget, or
    only the first ``columns`` prompts of each step) with the service's formulas. ``prompts``: per step, the
    columns' prompt token ids, for ``nearest_log_ratio`` (the zoo was scored before it existed)."""
    series: dict[str, list[tuple[int, float]]] = {}
    ema = EmaState()
    for i, step in enumerate(scored):
        if source == "service" and columns is None:
            values = dict(step["points"]["first_turn"])
        else:
            values, ema = recompute(step, int(source.split("@")[1]) if "@" in source else SERVICE_HEAD, columns, ema)
        if prompts is not None and "nearest_log_ratio" not in values:
            n = columns or len(step["signature"])
            cols = np.asarray(step["column_of_row"])
            keep = np.flatnonzero(cols < n)
            L_seq = np.asarray(step["L_seq"])[np.ix_(keep, range(n))]
            signature = np.asarray(step["signature"][:n])
            values["nearest_log_ratio"] = nearest_log_ratio(L_seq, cols[keep], signature, prompts[i][:n])
        for name, value in values.items():
            series.setdefault(name, []).append((step["step"], value))
    return series


def recompute(step: dict[str, Any], head: int, columns: int | None, ema: EmaState) -> tuple[dict[str, float], EmaState]:
    """One step's figures from its stored matrices, as the service computes them."""
    cols = np.asarray(step["column_of_row"])
    keep = np.flatnonzero(cols < columns) if columns is not None else np.arange(len(cols))
    n_cols = columns or len(step["signature"])
    L_seq = np.asarray(step["L_seq"])[np.ix_(keep, range(n_cols))]
    lengths = np.asarray(step["lengths"])[keep]
    L_head = np.asarray(step["L_head"][str(head)])[np.ix_(keep, range(n_cols))]
    signature = step["signature"][:n_cols]
    prompts = [[s] for s in signature]
    diagnostics, ema = compute_diagnostics(
        per_token(L_seq, lengths), L_seq, cols[keep], prompts, ema, EstimatorConfig(bootstrap_samples=0)
    )
    values = dict(diagnostics.metrics)
    values["mi_estimate_se"] = diagnostics.standard_errors["mi_estimate"]
    values["conditional_entropy_est"] = diagnostics.metrics["conditional_entropy_est"]
    reasonings = [step["reasonings"][r] for r in keep]
    values |= dependence_signals(
        per_token(L_seq, lengths),
        diagnostics.metrics,
        cols[keep],
        prompts,
        reasonings,
        DependenceConfig(permutations=0),
        head_per_token(L_head, lengths, head),
    )
    return values, ema


def fired(series: dict[str, list[tuple[int, float]]], settings: AlertSettings) -> int | None:
    episodes = evaluate("zoo", "first_turn", series, settings)
    return next((e.fired_step for e in episodes if e.rule == "TemplateCollapse" and e.fired_step is not None), None)


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None when either side is constant."""
    if len(a) < 3:
        return None
    ra, rb = _ranks(np.asarray(a, float)), _ranks(np.asarray(b, float))
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for value in np.unique(x):  # ties share their mean rank
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def arm_table(arms: list[str]) -> dict[str, Any]:
    """Per arm: its label, ground truth crossing, and each candidate's firing step."""
    out: dict[str, Any] = {}
    for arm in arms:
        record, scored = zoo.read_record(arm), zoo.read_scored(arm)
        truth = [s[GROUND_TRUTH] for s in record]
        entropy = [s["trl"].get("entropy", math.nan) for s in record]
        judged = protocol.label(truth, family_level(tasks.ZOO[arm].family), entropy)
        cross, label = judged["crossing"], judged["label"]
        sources = {source for _, _, source in CANDIDATES}
        prompts = column_prompts(record)
        series = {source: step_series(scored, source, prompts=prompts) for source in sources}
        out[arm] = {
            "driver": tasks.ZOO[arm].reward + ("/hard" if tasks.ZOO[arm].hard else ""),
            "family": tasks.ZOO[arm].family,
            "collapsed_at": cross,
            "label": label,
            "margin": judged["margin"],
            "policy_entropy": [round(e, 2) for e in entropy],
            "truth": [round(t, 3) for t in truth],
            "task_success": [round(s["task_success"], 3) for s in record],
            "mean_words": [round(s["mean_words"], 1) for s in record],
            "train_minutes": round(record[-1]["elapsed_seconds"] / 60, 1),
            "fired": {label: fired(series[source], AlertSettings(**fields)) for label, fields, source in CANDIDATES},
            "fired_by_prompts": {
                str(n): {
                    label: fired(step_series(scored, source, columns=n, prompts=prompts), AlertSettings(**fields))
                    for label, fields, source in CANDIDATES
                }
                for n in PROMPT_SUBSETS
            },
            "series": {name: [v for _, v in series["service"].get(name, [])] for name in CORRELATED},
        }
    return out


def summary(arms: dict[str, Any], by: Callable[[dict[str, Any]], dict[str, int | None]]) -> dict[str, Any]:
    """Per candidate: detections and delays on template collapses, false alarms on healthy arms, what it did on
    blow-ups."""
    table: dict[str, Any] = {}
    for label, _, _ in CANDIDATES:
        delays, missed, false_alarms, blow_ups = {}, [], [], {}
        for arm, a in arms.items():
            step = by(a)[label]
            if a["label"] == "blow-up":
                blow_ups[arm] = None if step is None else step - a["collapsed_at"]
            elif a["collapsed_at"] is None:
                if step is not None:
                    false_alarms.append(f"{arm}@{step}")
            elif step is None:
                missed.append(arm)
            else:
                delays[arm] = step - a["collapsed_at"]
        # Within 2 steps either side: the ground truth's half-level line is a convention, and a signal that
        # falls a step or two before the words do is early, not wrong. Further ahead, the words had not fallen:
        # an alarm on a dip the run recovered from, counted apart.
        on_time = [d for d in delays.values() if -EARLY <= d <= 2]
        table[label] = {
            "detected": f"{len(delays)}/{len(delays) + len(missed)}",
            "within_2_steps": len(on_time),
            "early": [f"{arm}@{arms[arm]['collapsed_at'] + d}" for arm, d in delays.items() if d < -EARLY],
            "median_delay": float(np.median(list(delays.values()))) if delays else None,
            "delays": delays,
            "missed": missed,
            "false_alarms": false_alarms,
            "blow_ups": blow_ups,
        }
    return table


def correlations(arms: dict[str, Any]) -> dict[str, Any]:
    """Spearman of each series with task success and with the ground truth: mean per arm, and pooled."""
    out: dict[str, Any] = {}
    for name in CORRELATED:
        per_arm_success, per_arm_truth, pooled = [], [], ([], [], [])
        for a in arms.values():
            values = a["series"][name]
            if len(values) != len(a["truth"]):
                continue
            for got, target in ((per_arm_success, a["task_success"]), (per_arm_truth, a["truth"])):
                rho = spearman(values, target)
                if rho is not None:
                    got.append(rho)
            pooled[0].extend(values)
            pooled[1].extend(a["task_success"])
            pooled[2].extend(a["truth"])
        out[name] = {
            "success_per_arm": _mean(per_arm_success),
            "success_pooled": _round(spearman(pooled[0], pooled[1])),
            "truth_per_arm": _mean(per_arm_truth),
            "truth_pooled": _round(spearman(pooled[0], pooled[2])),
        }
    return out


def markdown(result: dict[str, Any]) -> str:
    """The tables of docs/alerts.md: per arm what happened and when the default fired; per signal on 8, 6, 4, 3
    and 2 prompts a step; the Spearman correlations."""
    arms = result["arms"]
    n_template = sum(a["label"] == "template" for a in arms.values())
    n_healthy = sum(a["label"] == "healthy" for a in arms.values())
    default = CANDIDATES[0][0]
    lines = [
        "| arm | driver | label (margin to its boundary) | ground truth crossing | default fired | words-only "
        "retrieval, first / last step | task success, max | mean words, first / last | policy entropy, first / max "
        "| training, min |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, a in arms.items():
        lines.append(
            f"| {arm} | {a['driver']} | {a['label']} ({a['margin']}) | {a['collapsed_at'] or '-'} | "
            f"{a['fired'][default] or '-'} | "
            f"{a['truth'][0]} / {a['truth'][-1]} | {max(a['task_success'])} | {a['mean_words'][0]} / "
            f"{a['mean_words'][-1]} | {a['policy_entropy'][0]} / {max(a['policy_entropy'])} | {a['train_minutes']} |"
        )
    lines += [
        "",
        f"| signal (TemplateCollapse, run defaults otherwise) | of {n_template} template collapses, fired within 2 "
        f"steps of the crossing (8 / 6 / 4 / 3 / 2 prompts) | median delay, steps (8 prompts) | fired 3 or more "
        f"steps early (8 prompts) | false alarms on {n_healthy} healthy arms (8 / 6 / 4 / 3 / 2) | blow-ups "
        "caught (8 prompts) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, row in result["signals"].items():
        by = [row, *(result["by_prompts"][n][label] for n in ("6", "4", "3", "2"))]
        caught = sum(d is not None for d in row["blow_ups"].values())
        lines.append(
            f"| {label} | {' / '.join(str(r['within_2_steps']) for r in by)} "
            f"(detected {row['detected']}) | {row['median_delay']} | {', '.join(row['early']) or '-'} | "
            f"{' / '.join(str(len(r['false_alarms'])) for r in by)} | {caught} of {len(row['blow_ups'])} |"
        )
    lines += [
        "",
        "| series | Spearman with task success (mean per arm / pooled) | with the ground truth |",
        "| --- | --- | --- |",
    ]
    for name, c in result["correlations"].items():
        success, truth = (
            f"{c['success_per_arm']} / {c['success_pooled']}",
            f"{c['truth_per_arm']} / {c['truth_pooled']}",
        )
        lines.append(f"| `{name}` | {success} | {truth} |")
    return "\n".join(lines) + "\n"


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 3) if values else None


def _round(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=zoo.RECORDS / "signals.json")
    parser.add_argument("--markdown", action="store_true", help="print the docs' tables instead of the JSON")
    args = parser.parse_args()
    arms = [a for a in tasks.ZOO if zoo.scored_path(a).exists()]
    table = arm_table(arms)
    result = {
        "command": "python -m bench.real_run.signals",
        "arms": {a: {k: v for k, v in t.items() if k != "series"} for a, t in table.items()},
        "signals": summary(table, lambda a: a["fired"]),
        "by_prompts": {str(n): summary(table, lambda a, n=n: a["fired_by_prompts"][str(n)]) for n in PROMPT_SUBSETS},
        "correlations": correlations(table),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        print(markdown(result), end="")
    else:
        print(json.dumps({k: result[k] for k in ("signals", "correlations")}, indent=1))


if __name__ == "__main__":
    main()
