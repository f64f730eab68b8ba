"""A simulated agentic-RL run feeding a collapse-monitor server, to see the diagnostics move.

Each step sends rollouts of a grid puzzle: groups of rollouts per board, two turns each. Early on
the reasoning talks about the board in front of it and rewards vary within a group; from
``collapse_start`` on, a growing share of rollouts reasons from one generic template (varied
wording, so entropy stays up) and rewards stop varying: template collapse, which the mutual
information and retrieval accuracy see and entropy does not. Stdlib HTTP only.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from functools import partial
from typing import Any

from service.schemas import BatchStatus

ACTIONS = ("Up", "Down", "Left", "Right")
SYSTEM = (
    "<|im_start|>system\nYou are an agent solving a box-pushing puzzle on a grid. Each turn you see the board, "
    "think inside <think></think>, then answer one of Up, Down, Left, Right inside <answer></answer>.<|im_end|>\n"
)
TEMPLATES = (
    "I will think step by step and choose the best action to solve the puzzle.",
    "Let me think carefully and pick the action that solves the puzzle step by step.",
    "I should reason step by step and then choose the best move for this puzzle.",
    "Thinking step by step, I will select the most promising action to make progress.",
)


def board(rng: random.Random) -> dict[str, tuple[int, int]]:
    cells = rng.sample([(r, c) for r in range(1, 6) for c in range(1, 6)], 3)
    return {"player": cells[0], "box": cells[1], "goal": cells[2]}


def describe(b: dict[str, tuple[int, int]]) -> str:
    return (
        f"The player is at row {b['player'][0]} column {b['player'][1]}, the box at row {b['box'][0]} column "
        f"{b['box'][1]}, and the goal at row {b['goal'][0]} column {b['goal'][1]}."
    )


def grounded_thought(b: dict[str, tuple[int, int]], rng: random.Random) -> tuple[str, str]:
    (br, bc), (gr, gc) = b["box"], b["goal"]
    vertical = "down" if gr > br else "up"
    horizontal = "right" if gc > bc else "left"
    first = rng.choice([vertical, horizontal])
    thought = (
        f"The box is at row {br} column {bc} and the goal at row {gr} column {gc}. "
        f"I need to push it {abs(gr - br)} rows {vertical} and {abs(gc - bc)} columns {horizontal}, "
        f"so I go {first} first."
    )
    return thought, first.capitalize()


def rollouts(
    step: int, steps: int, collapse_start: int, groups: int, per_group: int, seed: int
) -> list[dict[str, Any]]:
    rng = random.Random(seed * 100_003 + step)
    collapsed_share = (
        0.0 if step < collapse_start else min(1.0, (step - collapse_start + 1) / max(steps - collapse_start, 1) * 1.5)
    )
    out = []
    for g in range(groups):
        boards = [board(rng)]
        boards.append({**boards[0], "player": (rng.randint(1, 5), rng.randint(1, 5))})
        for _ in range(per_group):
            collapsed = rng.random() < collapsed_share
            turns = []
            for t, b in enumerate(boards):
                user = f"Turn {t + 1}. {describe(b)} Choose your action."
                prompt = f"{SYSTEM}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
                if collapsed:
                    thought, action = rng.choice(TEMPLATES), rng.choice(ACTIONS)
                else:
                    thought, action = grounded_thought(b, rng)
                turns.append({"prompt": prompt, "response": f"<think>{thought}</think><answer>{action}</answer>"})
            reward = 0.0 if collapsed else float(rng.random() < 0.5)
            out.append({"group_id": g, "reward": reward, "turns": turns})
    return out


def _call(url: str, method: str = "GET", body: Any = None, token: str | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def run_demo(
    url: str,
    run: str = "demo-sokoban",
    steps: int = 24,
    collapse_start: int = 10,
    groups: int = 6,
    per_group: int = 4,
    seed: int = 0,
    report: Any = print,
    token: str | None = None,
) -> list[BatchStatus]:
    """Feeds ``steps`` batches and reports each step's diagnostics once scored; returns the statuses.

    ``token``: an API token that may write the run (once the server has tokens)."""
    call = partial(_call, token=token)
    status, body = call(
        f"{url}/v1/runs",
        "POST",
        {
            "name": run,
            "project": "demo",
            "metadata": {"algorithm": "PPO", "environment": "Sokoban (simulated)", "tags": ["demo"]},
            # One sampler and 12 rows keep a step to a few seconds with SmolLM2 on 2 CPU cores.
            "sampler": {"samplers": ["first_turn"], "num_samples": 12, "seed": seed},
        },
    )
    if status not in (200, 201):
        raise RuntimeError(f"creating the run failed ({status}): {body}")
    statuses: list[BatchStatus] = []
    for step in range(1, steps + 1):
        payload = {
            "step": step,
            "batch_id": f"{run}-{step}",
            "trajectories": rollouts(step, steps, collapse_start, groups, per_group, seed),
        }
        status, accepted = call(f"{url}/v1/runs/{run}/batches", "POST", payload)
        if status != 202:
            raise RuntimeError(f"step {step} was refused ({status}): {accepted}")
        while True:
            _, batch = call(f"{url}{accepted['status_url']}")
            if batch["status"] in ("done", "failed"):
                break
            time.sleep(0.2)
        statuses.append(BatchStatus.model_validate(batch))
        report(summary(step, statuses[-1]))
    _, alerts = call(f"{url}/v1/runs/{run}/alerts")
    report(f"alerts on {run}: {len(alerts)}" if alerts else f"no alerts on {run}")
    for alert in alerts:
        report(f"  [{alert['state']}] {alert['summary']}")
    return statuses


def summary(step: int, batch: BatchStatus) -> str:
    if batch.status == "failed" or batch.results is None:
        return f"step {step:3d}  {batch.status}: {batch.error}"
    sampler = (batch.results.samplers or {}).get("first_turn")
    metrics = sampler.metrics if sampler else {}

    def value(name: str) -> float:
        return float(metrics.get(name, float("nan")))

    return (
        f"step {step:3d}  MI {value('mi_estimate'):6.3f} nats  "
        f"retrieval {value('retrieval_accuracy'):5.2f} (chance {value('retrieval_chance_level'):4.2f})  "
        f"H(Z|X) {value('conditional_entropy_est'):5.2f}  "
        f"reward std {(batch.results.figures or {})['rollout/in_group_reward_std']:5.3f}  "
        f"({batch.scoring_seconds or 0:.1f}s)"
    )
