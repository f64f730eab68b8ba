"""What the corpus says before any simulation: entropy stays, input dependence goes.

    python -m bench.corpus.stats

Per half (8 prompts): one batch of every healthy trace, and one where every row is a template
trace (assigned to the prompts in turn), scored with the service's estimators. Prints one JSON object.
"""

from __future__ import annotations

import json

import numpy as np

from bench.corpus.simulate import halves, load
from scoring.estimators import EmaState, EstimatorConfig, compute_diagnostics, per_token

NAMES = ("mi_estimate", "retrieval_accuracy", "retrieval_chance_level", "conditional_entropy_est", "mi_zscore")


def main() -> None:
    c = load()
    L_tok_all = per_token(c.L_seq, c.lengths)
    out: dict[str, object] = {"traces": len(c.lengths), "scorer": c.raw["scorer"], "bisection": c.raw["bisection"]}
    healthy = np.flatnonzero(c.prompt_of_trace >= 0)
    template = np.flatnonzero(c.style_of_trace >= 0)
    out["healthy_nll_per_token_own_prompt"] = round(float(-L_tok_all[healthy, c.prompt_of_trace[healthy]].mean()), 4)
    out["template_nll_per_token_task_prompts"] = round(float(-np.nanmean(L_tok_all[template, : c.n_prompts])), 4)
    for s in range(c.n_styles):
        rows = c.templates(s)
        out[f"template_style_{s}_nll_per_token_task_prompts"] = round(
            float(-np.nanmean(L_tok_all[rows, : c.n_prompts])), 4
        )
    out["token_entropy_mean_healthy"] = round(float(np.concatenate([c.entropy[r] for r in healthy]).mean()), 4)
    out["token_entropy_mean_template"] = round(float(np.concatenate([c.entropy[r] for r in template]).mean()), 4)
    config = EstimatorConfig(bootstrap_samples=0)
    for half, prompts in halves(c.n_prompts).items():
        cols = list(prompts)
        rows = np.concatenate([c.healthy(p) for p in prompts])
        own = np.concatenate([np.full(len(c.healthy(p)), j) for j, p in enumerate(prompts)])
        batches = {"healthy": rows, "template": template}
        for kind, r in batches.items():
            column_of_row = own if kind == "healthy" else np.arange(len(r)) % len(cols)
            d, _ = compute_diagnostics(
                per_token(c.L_seq[np.ix_(r, cols)], c.lengths[r]),
                c.L_seq[np.ix_(r, cols)],
                column_of_row,
                None,
                EmaState(),
                config,
            )
            out[f"{half}_{kind}"] = {name: round(d.metrics[name], 4) for name in NAMES}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
