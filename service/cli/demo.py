"""A simulated agentic-RL run feeding a collapse-monitor server, to see the diagnostics move.

Each step sends rollouts of tasks from the SmolLM2 trace corpus (grid puzzles, arithmetic, word
problems, shopping choices, multi-turn histories): a group of rollouts per task, whose reasoning is
what SmolLM2-135M-Instruct really wrote for that task. Early on rewards vary within a group; from
``collapse_start`` on, a growing share of rollouts carries reasoning SmolLM2 wrote for a generic
"Solve the task." instruction (sampled at the temperature that keeps its entropy level) and
rewards stop varying: template collapse, which the mutual information and retrieval accuracy see
and entropy does not. Stdlib HTTP only.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from service.schemas.results import BatchStatus

TRACES = Path(__file__).with_name("demo_traces.json")  # extracted from bench/corpus/smollm2.json.gz


@lru_cache(maxsize=1)
def traces() -> dict[str, Any]:
    """Prompts and reasoning SmolLM2-135M-Instruct sampled (bench/corpus): healthy traces per prompt
    at temperature 1.0, template traces from a generic instruction at the matched temperature."""
    data: dict[str, Any] = json.loads(TRACES.read_text())
    return data


def __getattr__(name: str) -> Any:
    if name == "TEMPLATES":  # the template traces, loaded on first use
        return tuple(traces()["templates"])
    raise AttributeError(name)


def rollouts(
    step: int, steps: int, collapse_start: int, groups: int, per_group: int, seed: int
) -> list[dict[str, Any]]:
    data = traces()
    prompts, healthy, templates = data["prompts"], data["healthy"], data["templates"]
    if groups > len(prompts):
        raise ValueError(f"groups must be at most {len(prompts)} (the demo's prompts), got {groups}")
    rng = random.Random(seed * 100_003 + step)
    collapsed_share = (
        0.0 if step < collapse_start else min(1.0, (step - collapse_start + 1) / max(steps - collapse_start, 1) * 1.5)
    )
    out = []
    for g, prompt in enumerate(rng.sample(range(len(prompts)), groups)):
        for _ in range(per_group):
            collapsed = rng.random() < collapsed_share
            thought = rng.choice(templates if collapsed else healthy[prompt])
            turn = {"prompt": prompts[prompt], "response": f"<think>{thought}</think><answer>ok</answer>"}
            reward = 0.0 if collapsed else float(rng.random() < 0.5)
            out.append({"group_id": g, "reward": reward, "turns": [turn]})
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
            "metadata": {"algorithm": "PPO", "environment": "SmolLM2 corpus tasks (simulated)", "tags": ["demo"]},
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
            "idempotency_key": f"{run}-{step}",
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
