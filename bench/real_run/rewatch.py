"""An agent arm's record replayed through the on-alert arm's own watch (``agent.AlertWatch``: the service's
scoring of every step in process, first_turn, and the alert rules with the run defaults), one JSON line a step:
the figures the rules read and TemplateCollapse's state; then every episode of every rule at the end.

    python -m bench.real_run.rewatch bench/real_run/remedy/remedy-on-alert-s0.jsonl.gz [--cache-dir DIR]

Records trained before the watch's figures were kept in them (remedy-on-alert-s0) are read this way.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from scoring.config import CACHE_DIR


def main() -> None:
    from bench.real_run.agent import AlertWatch
    from service.alerts.rules import evaluate
    from service.schemas.alerts import AlertSettings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path)
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    args = parser.parse_args()
    watch = AlertWatch(args.cache_dir, smoke=False)
    with gzip.open(args.record, "rt") as f:
        steps = [line for line in map(json.loads, f) if "step" in line]
    for line in steps:
        fired = watch.fired(line["step"], line["episodes"], [e["reward"] for e in line["episodes"]])
        print(json.dumps({"step": line["step"], "fired": fired, **watch.latest()}), flush=True)
    for e in evaluate("rewatch", "first_turn", watch.series, AlertSettings()):
        print(json.dumps({"rule": e.rule, "state": e.state, "onset": e.onset_step, "fired": e.fired_step}))


if __name__ == "__main__":
    main()
