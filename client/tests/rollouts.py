"""Trajectories for the client tests."""

from __future__ import annotations


def trajectories(step: int, n_groups: int = 4, per_group: int = 2) -> list[dict]:
    """Text trajectories whose content depends on the step (so each step is a distinct batch)."""
    return [
        {
            "group_id": g,
            "reward": float((k + step) % 2),
            "prompt": f"<|im_start|>user\nPuzzle {g}: reach the goal.<|im_end|>\n<|im_start|>assistant\n",
            "response": f"<think>Step {step}, try {k}: go {['up', 'down', 'left', 'right'][g % 4]}.</think>Up",
        }
        for g in range(n_groups)
        for k in range(per_group)
    ]
