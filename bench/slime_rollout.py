"""What slime's rollout loop pays for ``collapse_monitor.integrations.slime.log_rollout``, per rollout.

    python bench/slime_rollout.py [--rollouts 30] [--prompts 32] [--samples 8] [--tokens 1024]

Starts ``collapse-monitor serve`` (scoring paused), then calls ``log_rollout`` as slime's
``log_rollout_data`` does, once per rollout, on rollouts of ``--prompts`` x ``--samples`` samples
with ``--tokens`` response tokens each (every fourth prompt multi-turn: two model runs around a
tool observation, decoded with the policy's tokenizer), in text and in token-id mode. The samples
are laid out as slime's ``Sample`` (client/tests/trainer_writers.py). Prints one JSON object: the
time on the rollout thread (conversion and queueing; delivery is the monitor's own thread) and
whether every rollout was delivered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from serving import percentiles, served

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client" / "tests"))


def rollout(tokenizer: Any, rollout_id: int, prompts: int, samples: int, tokens: int) -> list[Any]:
    from trainer_writers import Sample

    prompt_ids = tokenizer(f"user\nPuzzle {rollout_id}: reach the goal.\nassistant\n", add_special_tokens=False)[
        "input_ids"
    ]
    out = []
    for p in range(prompts):
        for k in range(samples):
            response = [(rollout_id + p + k + i) % 500 + 5 for i in range(tokens)]
            multi = p % 4 == 0
            mask = [0 if multi and tokens // 2 <= i < tokens // 2 + 32 else 1 for i in range(tokens)]
            out.append(
                Sample(
                    group_index=p,
                    index=p * samples + k,
                    prompt=f"user\nPuzzle {rollout_id}: reach the goal.\nassistant\n",
                    tokens=[*prompt_ids, *response],
                    response=tokenizer.decode(response),
                    response_length=tokens,
                    reward=float(k % 2),
                    loss_mask=mask if multi else None,
                    status=Sample.Status.COMPLETED,
                )
            )
    return out


def measure(url: str, folder: Path, args: argparse.Namespace, token_ids: bool) -> dict[str, Any]:
    from collapse_monitor.integrations import slime
    from transformers import AutoTokenizer

    run = f"bench-slime-{'ids' if token_ids else 'text'}"
    os.environ.update(
        COLLAPSE_MONITOR_URL=url, COLLAPSE_MONITOR_RUN=run, COLLAPSE_MONITOR_SPOOL_DIR=str(folder / "spool")
    )
    os.environ["COLLAPSE_MONITOR_TOKEN_IDS"] = "1" if token_ids else ""
    tokenizer = AutoTokenizer.from_pretrained(folder / "policy")
    slime_args = argparse.Namespace(hf_checkpoint=str(folder / "policy"), save=None, wandb_group=None, reward_key=None)
    rollouts = [rollout(tokenizer, i, args.prompts, args.samples, args.tokens) for i in range(args.rollouts)]
    seconds = []
    for rollout_id, samples in enumerate(rollouts):
        start = time.perf_counter()
        slime.log_rollout(rollout_id, slime_args, samples, {}, 1.0)
        seconds.append(time.perf_counter() - start)
        time.sleep(0.2)  # a rollout takes minutes in a real run; the sender keeps up meanwhile
    monitor = slime._monitors[(url, run)]
    delivered = monitor.close(timeout=120)
    slime._monitors.clear()
    return {**percentiles(seconds), "delivered": delivered, "sent": monitor.stats().sent, "rollouts": len(rollouts)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    from scoring.models import build_tiny_random

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_tiny_random()[1].save_pretrained(folder / "policy")
        settings = {
            "DATABASE_URL": f"sqlite:///{folder / 'bench.db'}",
            "DATA_DIR": str(folder),
            "DEFAULT_SCORER": "tiny-random",
            "SCORING_PAUSED": "true",
            "MAX_QUEUE_DEPTH": "1000000",
        }
        with served(settings) as url:
            result = {
                "samples_per_rollout": args.prompts * args.samples,
                "response_tokens": args.tokens,
                "text": measure(url, folder, args, token_ids=False),
                "token_ids": measure(url, folder, args, token_ids=True),
                "load_average": os.getloadavg(),
            }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
