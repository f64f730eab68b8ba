"""The real run's figures: per arm, the service's diagnostics against the text measures, alerts marked.

Drawn with matplotlib (a dev extra) from ``results.json`` alone, so they can be redrawn without
training: ``python -m bench.real_run.figures bench/real_run/results/results.json docs/images``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PANELS = (  # (title, [(label, where, name)])
    (
        "input dependence (service)",
        [
            ("MI, nats/token", "reference", "mi_estimate"),
            ("retrieval above chance", "reference", "retrieval_above_chance"),
            ("MI (policy scorer)", "policy", "mi_estimate"),
        ],
    ),
    (
        "entropy (service, nats/token)",
        [
            ("H(Z|X)", "reference", "conditional_entropy_est"),
            ("token entropy", "reference", "token_entropy_mean"),
            ("H(Z|X) (policy scorer)", "policy", "conditional_entropy_est"),
        ],
    ),
    (
        "text and task (trainer)",
        [
            ("share with the most common opening", "text", "opening_share"),
            ("... numbers masked", "text", "slot_template_share"),
            ("cross-prompt trigram overlap", "text", "cross_prompt_overlap"),
            ("task success", "text", "task_success"),
            ("completions naming both operands", "text", "mentions_operands"),
        ],
    ),
    (
        "reward (trainer and service)",
        [
            ("reward mean", "text", "reward_mean"),
            ("in-group reward std", "reference", "rollout/in_group_reward_std"),
        ],
    ),
)


def _series(steps: list[dict[str, Any]], where: str, name: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for s in steps:
        value = s.get(name) if where == "text" else s.get(where, {}).get(name)
        if isinstance(value, int | float):
            xs.append(s["step"])
            ys.append(float(value))
    return xs, ys


def draw(results: dict[str, Any], folder: Path) -> list[Path]:
    """One PNG per arm (``real-run-<arm>-figures.png``); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for arm, data in results["arms"].items():
        steps = data["steps"]
        figure, axes = plt.subplots(len(PANELS), 1, figsize=(9, 11), sharex=True)
        for axis, (title, lines) in zip(axes, PANELS, strict=True):
            for label, where, name in lines:
                xs, ys = _series(steps, where, name)
                axis.plot(xs, ys, marker="o", markersize=3, label=label)
            axis.set_title(title, fontsize=10)
            axis.legend(fontsize=8, loc="best")
            axis.grid(alpha=0.3)
            for mode, style in (("reference", "-"), ("policy", ":")):
                for alert in data["runs"][mode]["alerts"]:
                    if alert["fired_step"] is not None:
                        axis.axvline(alert["fired_step"], color="red", linestyle=style, alpha=0.7)
        passed = data["text"]["opening_share_above_half_step"]
        if passed is not None:
            for axis in axes:
                axis.axvline(passed, color="grey", linestyle="--", alpha=0.7)
        fired = [
            f"{a['rule']} ({mode}) fired at {a['fired_step']}"
            for mode in ("reference", "policy")
            for a in data["runs"][mode]["alerts"]
            if a["fired_step"] is not None
        ]
        figure.suptitle(
            f"real run, {arm} arm: "
            + ("; ".join(fired) if fired else "no alert fired")
            + (f"; opening share > 50% at {passed}" if passed is not None else ""),
            fontsize=10,
        )
        axes[-1].set_xlabel("training step (red: alert fired, solid reference / dotted policy scorer)")
        figure.tight_layout()
        path = folder / f"real-run-{arm}-figures.png"
        figure.savefig(path, dpi=80)
        plt.close(figure)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", type=Path)
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    for path in draw(json.loads(args.results.read_text()), args.folder):
        print(path)


if __name__ == "__main__":
    main()
