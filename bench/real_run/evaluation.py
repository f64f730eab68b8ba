"""The held-out tables (issue 36, docs/evaluation.md): the frozen alert defaults judged on runs scored after the freeze.

    python -m bench.real_run.evaluation   # bench/real_run/heldout/evaluation.json and docs/evaluation.md's tables

Reads every held-out arm that is trained and scored (``tasks.HELD_OUT``, ``envs.AGENT_ARMS``; records and
scoring in ``bench/real_run/heldout/``) and judges the service's own rules (``service.alerts.rules``) with
the defaults frozen in ``protocol.FREEZE``; each later freeze (``protocol.FREEZES``) judges the runs scored
after it. It refuses to run when the defaults differ from the latest freeze: a default changed since needs a
new freeze, judged on runs scored after it. Everything it judges by is
``bench.real_run.protocol``'s. Per arm: its label and margin, the crossing, the default's first firing
(single-turn: the first_turn sampler; multi-turn: first_turn or trajectory, RAGEN's two), the outcome,
resolutions mid-collapse, the candidate signals' firings (reported, not eligible until a new freeze), and
for multi-turn arms which turn fell first, by the words and by the scorer. Then the lead times.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.real_run import envs, protocol, tasks, zoo
from service.alerts.rules import evaluate
from service.schemas.alerts import AlertSettings

OUT = zoo.HELD_OUT_RECORDS / "evaluation.json"
GROUND_TRUTH = "word_retrieval_above_chance"
# Reported beside the default on the held-out runs, never chosen on them (a new freeze would judge them on
# runs scored after it): the dev table's closest rivals and the signal built for kind-keeping collapses.
CANDIDATES = ("retrieval_mrr", "mi_seq_normalized", "nearest_log_ratio")


def frozen_settings(freeze: dict[str, Any]) -> AlertSettings:
    """A freeze's alert settings; the latest freeze's must be the run defaults: the evaluation refuses defaults
    it was not frozen with."""
    settings = AlertSettings.model_validate(freeze["settings"])
    assert settings.model_dump(mode="json") == freeze["settings"], f"the freeze of {freeze['date']} omits a field"
    defaults = AlertSettings().model_dump(mode="json")
    latest = protocol.FREEZES[-1]
    if freeze is latest and defaults != latest["settings"]:
        changed = sorted(k for k, v in defaults.items() if latest["settings"].get(k) != v)
        raise SystemExit(
            f"the alert defaults differ from the freeze of {latest['date']} (commit {latest['commit']}) in "
            f"{', '.join(changed)}: freeze them anew (protocol.FREEZES) and judge them on runs scored after it"
        )
    return settings


def family_of(arm: str) -> str:
    return envs.AGENT_ARMS[arm].env if zoo.is_agent(arm) else tasks.ARMS[arm].family


def driver_of(arm: str) -> str:
    if zoo.is_agent(arm):
        spec = envs.AGENT_ARMS[arm]
        return spec.reward + ("/hard" if spec.hard else "") + f" lr {spec.learning_rate:g}"
    spec = tasks.ARMS[arm]
    return spec.reward + ("/hard" if spec.hard else "") + f" lr {spec.learning_rate:g}"


def entropy_of(step: dict[str, Any]) -> float:
    """The policy's own token entropy at a step (TRL's ``entropy``; the agent loop's ``policy_entropy``)."""
    return float(step["policy_entropy"] if "policy_entropy" in step else step["trl"].get("entropy", math.nan))


def levels(arms: Sequence[str]) -> dict[str, float]:
    """Per family, the truth's level over its held-out healthy controls, else over the development zoo's."""
    out = {}
    for family in {family_of(a) for a in arms}:
        controls = [a for a in arms if protocol.is_healthy_control(a, family)]
        if not controls:
            controls = [a for a in tasks.ZOO if protocol.is_healthy_control(a, family)]
        truths = [[s[GROUND_TRUTH] for s in zoo.read_record(a)] for a in controls]
        out[family] = protocol.family_level(truths) if controls else math.nan
    return out


def sampler_series(scored: list[dict[str, Any]], sampler: str) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for step in scored:
        for name, value in step["points"].get(sampler, {}).items():
            series.setdefault(name, []).append((step["step"], value))
    return series


def first_firing(
    scored: list[dict[str, Any]], samplers: Sequence[str], settings: AlertSettings
) -> tuple[int | None, list[dict[str, Any]]]:
    """The first step TemplateCollapse fired on any of ``samplers``, and every episode it had there."""
    episodes = []
    for sampler in samplers:
        for e in evaluate("heldout", sampler, sampler_series(scored, sampler), settings):
            if e.rule == "TemplateCollapse":
                episodes.append({"sampler": sampler, **{k: getattr(e, k) for k in ("state", "onset_step")},
                                 "fired_step": e.fired_step, "resolved_step": e.resolved_step})  # fmt: skip
    fired = [e["fired_step"] for e in episodes if e["fired_step"] is not None]
    return (min(fired) if fired else None), episodes


def turn_truth(record: list[dict[str, Any]], k: int) -> list[float | None]:
    """The words-only truth of turn index ``k`` (0-based) per step; None where no episode reached it."""
    return [s["per_turn"][k]["word_retrieval_above_chance"] if len(s["per_turn"]) > k else None for s in record]


def turn_levels(arms: Sequence[str], family: str) -> list[float]:
    """Per turn index, the level over the family's healthy controls (``protocol.family_level`` of that turn)."""
    records = [zoo.read_record(a) for a in arms if protocol.is_healthy_control(a, family)]
    if not records:  # no healthy control scored yet: no per-turn crossing
        return []
    n_turns = max(len(s["per_turn"]) for r in records for s in r)
    out = []
    for k in range(n_turns):
        truths = [turn_truth(r, k) for r in records]
        out.append(protocol.family_level(truths) if any(v is not None for t in truths for v in t) else math.nan)
    return out


def per_turn(
    record: list[dict[str, Any]], scored: list[dict[str, Any]], levels: list[float], settings: AlertSettings
) -> list[dict[str, Any]]:
    """Multi-turn: per turn index, the words' crossing (against that turn's healthy level) and the default rule's
    first firing on that turn's matrices (``turn_k``, which the service does not alert on: the same rule
    replayed here)."""
    out = []
    for k in range(max(len(s["per_turn"]) for s in record)):
        level = levels[k] if k < len(levels) else math.nan
        cross = protocol.crossing(turn_truth(record, k), level) if level > 0 else None
        fired, _ = first_firing(scored, [f"turn_{k + 1}"], settings)
        out.append({"turn": k + 1, "crossing": cross, "fired": fired})
    return out


def judge(arms: Sequence[str], freeze: dict[str, Any], controls: Sequence[str] | None = None) -> dict[str, Any]:
    """``arms`` judged by ``freeze``'s rule, the levels from the healthy controls among ``controls`` (default:
    ``arms``; a later freeze's runs take the whole held-out table's, the truth being no freeze's)."""
    settings = frozen_settings(freeze)
    controls = arms if controls is None else controls
    level = levels(controls)
    turn_level = {f: turn_levels(controls, f) for f in envs.ENVS if any(family_of(a) == f for a in arms)}
    table: dict[str, Any] = {}
    waiting = [a for a in arms if not level.get(family_of(a), math.nan) > 0]  # no healthy control: no level
    for arm in (a for a in arms if a not in waiting):
        record, scored = zoo.read_record(arm), zoo.read_scored(arm)
        truth = [s[GROUND_TRUTH] for s in record]
        entropy = [entropy_of(s) for s in record]
        judged = protocol.label(truth, level[family_of(arm)], entropy)
        samplers = ("first_turn", "trajectory") if zoo.is_agent(arm) else ("first_turn",)
        fired, episodes = first_firing(scored, samplers, settings)
        success = [s["task_success"] for s in record]
        reward = [s["reward_mean"] for s in record]
        candidates = {}
        for name in CANDIDATES:
            step, _ = first_firing(scored, samplers, settings.model_copy(update={"signal": name}))
            candidates[name] = {"fired": step, "outcome": protocol.outcome(step, judged["crossing"])}
        table[arm] = {
            "kind": "multi-turn" if zoo.is_agent(arm) else "single-turn",
            "family": family_of(arm),
            "driver": driver_of(arm),
            **judged,
            "fired": fired,
            "outcome": protocol.outcome(fired, judged["crossing"]),
            "delay": None if fired is None or judged["crossing"] is None else fired - judged["crossing"],
            "resolved_mid_collapse": protocol.resolved_mid_collapse(episodes, truth, level[family_of(arm)]),
            "episodes": episodes,
            "candidates": candidates,
            "truth": [None if t is None else round(t, 3) for t in truth],
            "task_success": [round(s, 3) for s in success],
            "reward": [round(r, 3) for r in reward],
            "policy_entropy": [round(e, 3) for e in entropy],
            "success_fall": protocol.fall(success),
            "reward_fall": protocol.fall(reward),
            "per_turn": per_turn(record, scored, turn_level[family_of(arm)], settings) if zoo.is_agent(arm) else None,
        }
        a = table[arm]
        a["lead_success"] = protocol.lead(fired, a["success_fall"])
        a["lead_reward"] = protocol.lead(fired, a["reward_fall"])
    return {
        "freeze": freeze,
        "levels": {k: round(v, 4) for k, v in sorted(level.items()) if v > 0 and any(family_of(a) == k for a in arms)},
        "waiting_for_a_healthy_control": waiting,
        "arms": table,
        "summary": summary(table),
    }


def summary(table: dict[str, Any]) -> dict[str, Any]:
    """The counts the docs state: per kind of run and for all, the default's and each candidate's."""
    out: dict[str, Any] = {}
    for kind in ("all", "single-turn", "multi-turn"):
        arms = {a: t for a, t in table.items() if kind == "all" or t["kind"] == kind}
        row: dict[str, Any] = {
            "runs": len(arms),
            "template": sum(t["label"] == "template" for t in arms.values()),
            "blow-up": sum(t["label"] == "blow-up" for t in arms.values()),
            "healthy": sum(t["label"] == "healthy" for t in arms.values()),
        }
        for name, outcome_of in (("default", lambda t: t["outcome"]), *(
            (c, lambda t, c=c: t["candidates"][c]["outcome"]) for c in CANDIDATES
        )):  # fmt: skip
            outcomes = [(t["label"], outcome_of(t)) for t in arms.values()]
            row[name] = {
                "caught": sum(o == "caught" for label, o in outcomes if label == "template"),
                "early": sum(o == "early" for label, o in outcomes if label == "template"),
                "late": sum(o == "late" for label, o in outcomes if label == "template"),
                "missed": sum(o == "missed" for label, o in outcomes if label == "template"),
                "false_alarms": sum(o == "false alarm" for _, o in outcomes),
                "blow_ups_caught": sum(o == "caught" for label, o in outcomes if label == "blow-up"),
            }
        out[kind] = row
    return out


def markdown(result: dict[str, Any]) -> str:
    """The tables of docs/evaluation.md: the first freeze's on every held-out run, then each later freeze's on
    the runs scored after it."""
    arms = result["arms"]
    lines = [*arm_rows(arms), "", *summary_rows(result["summary"])]
    turns = {arm: a for arm, a in arms.items() if a["per_turn"]}
    if turns:
        lines += [
            "",
            "| multi-turn arm | label | per turn: words-only crossing / default rule fired on turn_k |",
            "| --- | --- | --- |",
        ]
        for arm, a in turns.items():
            cells = "; ".join(f"turn {t['turn']}: {t['crossing'] or '-'} / {t['fired'] or '-'}" for t in a["per_turn"])
            lines.append(f"| {arm} | {a['label']} | {cells} |")
    lines += [
        "",
        "| arm | default fired | success fell (step) | lead over success | reward fell (step) | lead over reward |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for arm, a in arms.items():
        if a["success_fall"] is None and a["reward_fall"] is None:
            continue
        lines.append(
            f"| {arm} | {a['fired'] or '-'} | {a['success_fall'] or '-'} | {_signed(a['lead_success'])} | "
            f"{a['reward_fall'] or '-'} | {_signed(a['lead_reward'])} |"
        )
    for later in result["later_freezes"]:
        freeze = later["freeze"]
        lines += [
            "",
            f"**Judged by the freeze of {freeze['date']}** ({freeze['change']}), on the runs scored after it:",
        ]
        waiting = ", ".join(later["waiting_for_a_healthy_control"])
        if not later["arms"]:
            lines += [
                "",
                "No run scored after it yet" + (f" but {waiting}, waiting for a healthy control." if waiting else "."),
            ]
            continue
        lines += ["", *arm_rows(later["arms"]), "", *summary_rows(later["summary"])]
    return "\n".join(lines) + "\n"


def arm_rows(arms: dict[str, Any]) -> list[str]:
    lines = [
        "| arm | kind | driver | label (margin) | crossing | default fired | outcome | resolved mid-collapse | "
        "words-only truth, first / last | task success, first / max / last | policy entropy, first / max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, a in arms.items():
        truth = [t for t in a["truth"] if t is not None]
        lines.append(
            f"| {arm} | {a['kind']} | {a['driver']} | {a['label']} ({a['margin']}) | {a['crossing'] or '-'} | "
            f"{a['fired'] or '-'} | {a['outcome']} | {', '.join(map(str, a['resolved_mid_collapse'])) or '-'} | "
            f"{truth[0]} / {truth[-1]} | {a['task_success'][0]} / {max(a['task_success'])} / "
            f"{a['task_success'][-1]} | {a['policy_entropy'][0]} / {max(a['policy_entropy'])} |"
        )
    return lines


def summary_rows(summary: dict[str, Any]) -> list[str]:
    lines = [
        "| signal | runs | template collapses: caught within 2 / early / late / missed | false alarms on healthy "
        "arms | blow-ups caught |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind, row in summary.items():
        for name in ("default", *CANDIDATES):
            r = row[name]
            label = "the frozen default" if name == "default" else f"{name} (candidate)"
            lines.append(
                f"| {label}, {kind} | {row['runs']} ({row['template']} template, {row['blow-up']} blow-up, "
                f"{row['healthy']} healthy) | {r['caught']} / {r['early']} / {r['late']} / {r['missed']} | "
                f"{r['false_alarms']} of {row['healthy']} | {r['blow_ups_caught']} of {row['blow-up']} |"
            )
    return lines


def remedy(arms: Sequence[str]) -> dict[str, Any]:
    """The remedy trial: per arm its held-out greedy success over training and at the end, the area under its
    words-only truth curve (the mean over steps), what its filter did; per filter, paired differences from no
    filter on the same seeds, with a bootstrap interval over seeds and a two-sided sign test."""
    runs: dict[str, Any] = {}
    for arm in arms:
        lines = zoo.read_record(arm)
        steps = [s for s in lines if "step" in s]
        final = next((s["final"] for s in lines if "final" in s), None)
        if final is None:  # still training
            continue
        truth = [s[GROUND_TRUTH] for s in steps if s[GROUND_TRUTH] is not None]
        spec = envs.REMEDY_ARMS[arm]
        runs[arm] = {
            "filter": spec.filter,
            "seed": spec.seed,
            "eval": [[s["step"], s["eval"]["success"]] for s in steps if s.get("eval")]
            + [[final["step"] + 1, final["eval"]["success"]]],
            "final_success": final["eval"]["success"],
            "truth_area": round(float(np.mean(truth)), 4),
            "steps_trained": len(steps),
            "skipped_steps": sum(bool(s["skipped"]) for s in steps),
            "kept_share": round(
                float(np.mean([1.0 if s["kept_groups"] is None else len(s["kept_groups"]) / 8 for s in steps])), 3
            ),
            "alert_fired_at": next((s["step"] for s in steps if s.get("alert_fired")), None),
        }
    paired: dict[str, Any] = {}
    for name in envs.REMEDY_FILTERS[1:]:
        pairs = [
            (runs[a], runs[f"remedy-none-s{runs[a]['seed']}"])
            for a in runs
            if runs[a]["filter"] == name and f"remedy-none-s{runs[a]['seed']}" in runs
        ]
        if not pairs:
            continue
        paired[name] = {
            key: _paired([x[key] - y[key] for x, y in pairs]) for key in ("final_success", "truth_area")
        } | {"seeds": sorted(x["seed"] for x, _ in pairs)}
    return {"runs": runs, "paired_with_no_filter": paired}


def _paired(differences: list[float]) -> dict[str, Any]:
    """Mean paired difference, its 95% bootstrap interval over seeds (10,000 resamples, seeded), and the
    two-sided sign test's p (ties dropped)."""
    d = np.asarray(differences, dtype=np.float64)
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, len(d), (10_000, len(d)))].mean(axis=1)
    positive, negative = int((d > 0).sum()), int((d < 0).sum())
    n = positive + negative
    tail = sum(math.comb(n, k) for k in range(0, min(positive, negative) + 1)) / 2**n if n else 1.0
    return {
        "differences": [round(float(x), 4) for x in d],
        "mean": round(float(d.mean()), 4),
        "interval": [round(float(np.percentile(means, 2.5)), 4), round(float(np.percentile(means, 97.5)), 4)],
        "sign_test_p": round(min(1.0, 2 * tail), 4),
    }


def remedy_markdown(trial: dict[str, Any]) -> str:
    """The remedy tables of docs/evaluation.md."""
    lines = [
        "| arm | held-out greedy success at steps (before each) | final | truth area | skipped steps | kept share "
        "| alert fired |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, r in trial["runs"].items():
        curve = ", ".join(f"{step}: {success:.3f}" for step, success in r["eval"])
        lines.append(
            f"| {arm} | {curve} | {r['final_success']:.3f} | {r['truth_area']} | {r['skipped_steps']} of "
            f"{r['steps_trained']} | {r['kept_share']} | {r['alert_fired_at'] or '-'} |"
        )
    lines += [
        "",
        "| filter, minus no filter on the same seeds | seeds | final success: mean (95% bootstrap) / sign test p | "
        "truth area: mean (95% bootstrap) / sign test p |",
        "| --- | --- | --- | --- |",
    ]
    for name, p in trial["paired_with_no_filter"].items():
        cells = [
            f"{d['mean']:+.3f} ({d['interval'][0]:+.3f}, {d['interval'][1]:+.3f}) / {d['sign_test_p']}"
            for d in (p["final_success"], p["truth_area"])
        ]
        lines.append(f"| {name} | {', '.join(map(str, p['seeds']))} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def _signed(value: int | None) -> str:
    return "-" if value is None else f"{value:+d}"


def remedy_arms() -> list[str]:
    """The remedy trial's arms trained so far."""
    return [a for a in envs.REMEDY_ARMS if zoo.record_path(a).exists()]


def held_out_arms() -> list[str]:
    """The held-out arms trained and scored so far, single-turn first."""
    return [a for a in (*tasks.HELD_OUT, *envs.AGENT_ARMS) if zoo.scored_path(a).exists()]


DOCS = zoo.ROOT / "docs" / "evaluation.md"
START = "<!-- held-out tables: generated by python -m bench.real_run.evaluation -->\n"
END = "<!-- end of held-out tables -->"


def build() -> dict[str, Any]:
    """Everything evaluation.json holds, from the committed records: every held-out run judged by the first
    freeze, the runs scored after each later freeze judged by it, and the remedy trial."""
    arms = held_out_arms()
    later = [judge([a for a in arms if a not in f["seen"]], f, arms) for f in protocol.FREEZES[1:]]
    return (
        {"command": "python -m bench.real_run.evaluation"}
        | judge(arms, protocol.FREEZE)
        | {"later_freezes": later, "remedy": remedy(remedy_arms())}
    )


def tables(result: dict[str, Any]) -> str:
    """docs/evaluation.md's generated section."""
    return markdown(result) + "\n" + remedy_markdown(result["remedy"])


def write_docs(section: str) -> None:
    """Puts the tables into docs/evaluation.md between their markers."""
    text = DOCS.read_text()
    head, rest = text.split(START, 1)
    DOCS.write_text(head + START + section + END + rest.split(END, 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    result = build()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    write_docs(tables(result))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
