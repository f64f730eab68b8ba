"""The evaluation protocol (issue 36, docs/evaluation.md): the one home of every rule the tables judge by.

Written, and the alert defaults frozen (``FREEZE``), before any held-out run was scored; a later freeze
(``FREEZE_2``) judges only the runs scored after it. Pure Python
and NumPy: no torch, no service.

* **Truth**, per step, read from words only: the completions' retrieval of their own prompt by the
  slot words they name, chance-corrected (``tasks.word_retrieval``); for a multi-turn arm, the mean
  over turn indices of the same per turn (``agent.step_figures``).
* **Level**: the mean truth over every step of the family's healthy controls (arms ``<family>-healthy``
  and ``<family>-healthy-s<n>``) of the same table; a held-out family without one takes the
  development table's.
* **Crossing**: the first step s >= 2 where the truth is below half the level and stays below it for
  ``SUSTAIN`` steps (s, s+1, s+2); where the run ends first, every step to its end below and at least 2 of
  them. ``sustained_below`` is the rule, also for the falls of success and reward.
* **Labels**: ``healthy`` (no crossing), ``blow-up`` (the policy's entropy at the crossing or the two
  steps after it more than ``BLOW_UP`` times its step-1 value: text that reads nothing because it
  reads nothing at all, EntropyCollapse's case), ``template`` otherwise. Each arm's margin to its label
  boundary is printed (``margin``).
* **Endpoints**: the delay is the first TemplateCollapse firing minus the crossing; a collapse is
  *caught* when the delay lies within +-``WITHIN`` steps, *early* before, *late* after, *missed* without
  a firing; a *false alarm* is any firing on a healthy arm; a firing episode that *resolved* while the
  truth was still below half the level resolved mid-collapse.
* **Lead time**: where task success (or reward) falls, the steps from the first firing to the first
  sustained fall below half its mean over steps 1-3 (positive: the alert came first).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

HALF = 0.5  # the crossing's share of the healthy level
SUSTAIN = 3  # steps a crossing (or a fall) holds
BLOW_UP = 3.0  # policy entropy at the crossing over its step-1 value: past it, a blow-up
WITHIN = 2  # a firing within this many steps of the crossing, either side, caught it
# The alert defaults every held-out run is judged by, frozen before the first was scored: the commit that
# froze them and their values (service.schemas.alerts.AlertSettings at that commit). A default changes
# only through a new, dated freeze, judged on runs scored after it.
FREEZE = {
    "date": "2026-12-06",
    "commit": "a6a98b114c371587b9af06b20d532de043dc9d18",
    "settings": {
        "enabled": True,
        "signal": "retrieval_chance_corrected",
        "threshold": None,
        "drop_fraction": 0.2,
        "cusum_drop": 0.4,
        "cusum_threshold": 3.0,
        "baseline_steps": 3,
        "window": 2,
        "resolve_window": 2,
        "release_fraction": 0.5,
        "min_prompts": 4,
        "entropy_signal": "conditional_entropy_est",
        "entropy_band": 0.25,
        "entropy_band_above": 2.0,
        "entropy_floor": 0.5,
        "reward_std_fraction": 0.1,
        "reward_window": 10,
        "zero_variance_ratio": 0.5,
        "use_intervals": False,
        # Not a field yet at this freeze (added with FREEZE_2): True is the rule this freeze judged by.
        "entropy_band_while_firing": True,
    },
}
# The second freeze: one change, found on the held-out runs (rooms-starved-s0's first_turn episode resolved
# mid-collapse as H(Z|X) rose with the blow-up), so it is judged only on the held-out runs not yet scored
# when it was made: every arm but those in "seen" (scored, or partly scored, under the first freeze).
FREEZE_2 = {
    "date": "2026-12-07",
    "commit": "4e8e01c068d4bc1fd86099784d54bce9c382f817",
    "change": "entropy_band_while_firing: false (once an episode fires, only the signal's recovery resolves it)",
    "seen": [
        "arith-healthy-s2",
        "arith-lr-s2",
        "arith-style-s2",
        "arith-consensus-s2",
        "word-healthy-s2",
        "word-starved-s2",
        "reverse-shape-s2",
        "mixed-healthy-s2",
        "mixed-style-s2",
        "rooms-healthy-s0",
        "rooms-long-s0",
        "rooms-starved-s0",
        "rooms-blind-s0",
        "rooms-lr-s0",
        "shop-healthy-s0",
    ],
    "settings": {**FREEZE["settings"], "entropy_band_while_firing": False},
}
FREEZES = (FREEZE, FREEZE_2)


def sustained_below(series: Sequence[float | None], bar: float, start: int = 2) -> int | None:
    """The 1-based first step s >= ``start`` where ``series`` is below ``bar`` at s and the next ``SUSTAIN`` - 1
    steps (or every step to the end, at least 2 of them, where the run ends first); None when there is none.
    A missing value (None) is not below."""
    n = len(series)
    for s in range(start, n + 1):
        window = series[s - 1 : s - 1 + SUSTAIN]
        long_enough = len(window) == SUSTAIN or (s - 1 + len(window) == n and len(window) >= 2)
        if long_enough and all(v is not None and v < bar for v in window):
            return s
    return None


def crossing(truth: Sequence[float | None], level: float) -> int | None:
    """The step the truth fell below half the healthy level for good (module docstring)."""
    return sustained_below(truth, HALF * level)


def family_level(truths: Sequence[Sequence[float | None]]) -> float:
    """The level: the mean truth over every step of the family's healthy controls."""
    values = [v for truth in truths for v in truth if v is not None]
    return float(np.mean(values))


def is_healthy_control(arm: str, family: str) -> bool:
    """``<family>-healthy`` or ``<family>-healthy-s<n>``: the controls whose truth sets the family's level."""
    return arm == f"{family}-healthy" or (arm.startswith(f"{family}-healthy-s") and arm.rsplit("-s", 1)[1].isdigit())


def label(truth: Sequence[float | None], level: float, entropy: Sequence[float]) -> dict[str, Any]:
    """An arm's label, crossing and margin to its label's boundary (module docstring)."""
    cross = crossing(truth, level)
    if cross is None:
        lowest = min((v for v in truth[1:] if v is not None), default=math.nan)
        return {
            "label": "healthy",
            "crossing": None,
            "margin": f"lowest truth from step 2 {lowest / level:.2f} of the level (a crossing needs < {HALF})",
        }
    ratio = max(entropy[cross - 1 : cross + 2]) / entropy[0]
    name = "blow-up" if ratio > BLOW_UP else "template"
    return {
        "label": name,
        "crossing": cross,
        "margin": f"policy entropy x{ratio:.2f} of step 1 at the crossing (a blow-up needs > x{BLOW_UP:g})",
    }


def outcome(fired: int | None, cross: int | None) -> str:
    """What a firing (the first, or None) means on an arm with this crossing (None: healthy)."""
    if cross is None:
        return "false alarm" if fired is not None else "quiet"
    if fired is None:
        return "missed"
    delay = fired - cross
    return "caught" if abs(delay) <= WITHIN else "early" if delay < 0 else "late"


def resolved_mid_collapse(
    episodes: Sequence[Mapping[str, Any]], truth: Sequence[float | None], level: float
) -> list[int]:
    """The steps at which a fired episode resolved while the truth was still below half the level."""
    out = []
    for e in episodes:
        step = e.get("resolved_step")
        if step is not None and e.get("fired_step") is not None:
            value = truth[step - 1] if step <= len(truth) else None
            if value is not None and value < HALF * level:
                out.append(int(step))
    return out


def fall(series: Sequence[float]) -> int | None:
    """The first sustained fall of a series below half its mean over steps 1-3 (from step 4 on); None when
    its start is not above 0 (nothing to fall from) or it never falls."""
    start = float(np.mean(series[:3]))
    return sustained_below(series, HALF * start, start=4) if start > 0 else None


def lead(fired: int | None, fell: int | None) -> int | None:
    """Steps from the first firing to the fall (positive: the alert came first); None without both."""
    return None if fired is None or fell is None else fell - fired
