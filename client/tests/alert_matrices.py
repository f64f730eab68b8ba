"""Alerts on demand for the client tests: the service's own rules on cross-scoring matrices posted to a run.

``post_matrices`` posts matrices (``POST /v1/runs/{run}/matrices``, scored at once) whose rows depend on
their prompt (healthy) or prefer another prompt than their own (input dependence gone, entropy unchanged:
template collapse), under sampler ``matrix``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import httpx
from rollouts import trajectories

from collapse_monitor import AlertEvent, Monitor

# TemplateCollapse from the first scored step on: the baseline is step 1, the condition must hold
# two steps to fire, one healthy step resolves it.
ALERTS = {"baseline_steps": 1, "window": 2, "resolve_window": 1}
N_PROMPTS, PER_PROMPT, LENGTH = 4, 3, 10


def unjudged(step: int) -> list[dict]:
    """Trajectories of one prompt: logged as a trainer would, but with one prompt there is nothing to retrieve (no
    chance-corrected retrieval), so only the posted matrices (sampler ``matrix``) can raise TemplateCollapse.
    (Several prompts scored by the tiny random model raise it by chance, on some step, racing the matrices.)"""
    return trajectories(step, n_groups=1)


def matrix(step: int, collapsed: bool) -> dict:
    """Rows score -2 nats per token under their own prompt; healthy rows 2 nats less under others,
    collapsed rows 0.1 nats *more* under others (retrieval at zero, H(Z|X) within its band)."""
    own = [g for g in range(N_PROMPTS) for _ in range(PER_PROMPT)]
    other = -1.9 if collapsed else -4.0
    per_token = [[-2.0 if column == g else other for column in range(N_PROMPTS)] for g in own]
    return {
        "step": step,
        "idempotency_key": f"matrix-{step}-{collapsed}",
        "row_group_ids": own,
        "reasoning_lengths": [LENGTH] * len(own),
        "L_seq": [[v * LENGTH for v in row] for row in per_token],
    }


def post_matrices(url: str, run: str, steps: dict[int, bool]) -> None:
    for step, collapsed in steps.items():
        response = httpx.post(f"{url}/v1/runs/{run}/matrices", json=matrix(step, collapsed), timeout=30)
        assert response.status_code == 201, response.text


def wait_for(condition: Callable[[], bool], timeout: float = 60.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def polls_after(monitor: Monitor, n: int = 2) -> None:
    """Waits until the watchers have answered ``n`` more polls (what they will deliver, they have)."""
    start = monitor.stats().alert_polls
    wait_for(lambda: monitor.stats().alert_polls >= start + n, what=f"{n} more polls")


def states(events: Sequence[AlertEvent]) -> list[tuple[str, str, str, int]]:
    return [(e.rule, e.sampler, e.state, e.step) for e in events]
