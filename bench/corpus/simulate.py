"""Simulated training runs replayed from the SmolLM2 corpus: which rows each step sends, and their scores.

A run trains on the prompts of one half of the corpus (``HALVES``). Each step sends ``rows`` rows,
the same number per prompt, with the rows of every prompt drawn from that prompt's healthy traces,
except that a share of them (the template share) is drawn from the template pool of the run's
template style instead. A row's scores are the corpus matrix entries log p(z | x_j) for the half's
prompts: an entry does not depend on the other rows of its batch, so this is what scoring the
batch would give. The stories:

    healthy   no template rows.
    sharp     the template share jumps from 0 to ``SHARP_SHARE`` at the onset step.
    gradual   it grows by ``GRADUAL_RATE`` per step from the onset (50% three steps after it).
    partial   a quarter of the prompts go fully template at the onset; the others stay healthy.
    mixture   from the onset the policy is the mixture (1 - a) p(z | x) + a p_T(z), a = SHARP_SHARE:
              rows are drawn from it and every entry is scored under it,
              log((1 - a) p(z | x_j) + a p(z | x_T)).
Rewards follow the story: a healthy row of prompt j succeeds with the prompt's own probability
(drawn per run in [0.2, 0.8]), a template row always fails, so in-group reward variance shrinks as
the template share grows. Token entropies are the trace's own (under the prompt that generated it).
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

CORPUS = Path(__file__).with_name("smollm2.json.gz")
KINDS = ("healthy", "sharp", "gradual", "partial", "mixture")
SHARP_SHARE = 0.9
GRADUAL_RATE = 0.125
PARTIAL_SHARE = 0.25  # of the half's prompts


@dataclass(frozen=True)
class Corpus:
    """The committed corpus as arrays. Columns: the task prompts, then one per template style."""

    L_seq: np.ndarray  # [traces, columns] float64 nats
    lengths: np.ndarray  # [traces] reasoning tokens
    entropy: tuple[np.ndarray, ...]  # per trace, [T] token entropies under its own prompt
    prompt_of_trace: np.ndarray  # [traces] task prompt index, -1 for template traces
    style_of_trace: np.ndarray  # [traces] template style, -1 for healthy traces
    n_prompts: int
    n_styles: int
    raw: dict[str, Any] = field(repr=False)

    def healthy(self, prompt: int) -> np.ndarray:
        return np.flatnonzero(self.prompt_of_trace == prompt)

    def templates(self, style: int) -> np.ndarray:
        return np.flatnonzero(self.style_of_trace == style)

    def template_column(self, style: int) -> int:
        return self.n_prompts + style


@lru_cache(maxsize=2)
def load(path: Path = CORPUS) -> Corpus:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        raw = json.load(f)
    traces = raw["traces"]
    return Corpus(
        L_seq=np.array(raw["L_seq"], dtype=np.float64),
        lengths=np.array([len(t["token_ids"]) for t in traces], dtype=np.int64),
        entropy=tuple(np.array(e, dtype=np.float64) for e in raw["token_entropy"]),
        prompt_of_trace=np.array([t["prompt"] if t["kind"] == "healthy" else -1 for t in traces]),
        style_of_trace=np.array([t["style"] if t["kind"] == "template" else -1 for t in traces]),
        n_prompts=sum(c["kind"] == "task" for c in raw["columns"]),
        n_styles=sum(c["kind"] == "template" for c in raw["columns"]),
        raw=raw,
    )


def halves(n_prompts: int) -> dict[str, tuple[int, ...]]:
    """Calibration: the even prompts; evaluation: the odd ones (each half holds every family)."""
    return {"calibration": tuple(range(0, n_prompts, 2)), "evaluation": tuple(range(1, n_prompts, 2))}


@dataclass(frozen=True)
class Story:
    kind: str
    onset: int | None  # first collapsed step
    collapsed: tuple[int, ...] = ()  # prompts that collapse (all of them but for partial)

    def share(self, step: int) -> float:
        """Template share of the collapsing prompts' rows at ``step``."""
        if self.onset is None or step < self.onset:
            return 0.0
        if self.kind == "gradual":
            return min(1.0, GRADUAL_RATE * (step - self.onset + 1))
        return 1.0 if self.kind == "partial" else SHARP_SHARE

    def half_step(self) -> int | None:
        """First step where the template share reaches 50% (the gradual target's reference)."""
        if self.onset is None:
            return None
        return self.onset + math.ceil(0.5 / GRADUAL_RATE) - 1 if self.kind == "gradual" else self.onset


def story(kind: str, prompts: tuple[int, ...], onset: int | None, rng: np.random.Generator) -> Story:
    if kind == "healthy":
        return Story(kind, None)
    if kind == "partial":
        n = max(1, round(PARTIAL_SHARE * len(prompts)))
        return Story(kind, onset, tuple(sorted(int(p) for p in rng.choice(prompts, n, replace=False))))
    return Story(kind, onset, prompts)


class Run:
    """One simulated run: draws each step's rows from the corpus under its story."""

    def __init__(self, corpus: Corpus, prompts: tuple[int, ...], rows: int, story: Story, seed: int) -> None:
        if rows % len(prompts):
            raise ValueError(f"rows ({rows}) must be a multiple of the prompts per step ({len(prompts)})")
        self.corpus, self.prompts, self.story = corpus, prompts, story
        self.per_prompt = rows // len(prompts)
        self.rng = np.random.default_rng(seed)
        self.style = int(self.rng.integers(corpus.n_styles))
        self.success = {p: float(self.rng.uniform(0.2, 0.8)) for p in prompts}

    def step(self, step: int) -> dict[str, Any]:
        """The matrices-endpoint payload of one step (without step bookkeeping fields)."""
        c, rng = self.corpus, self.rng
        share = self.story.share(step)
        mixture = self.story.kind == "mixture" and share > 0
        pool = c.templates(self.style)
        traces, groups, rewards = [], [], []
        for p in self.prompts:
            own_share = share if p in self.story.collapsed else 0.0
            healthy = rng.choice(c.healthy(p), self.per_prompt, replace=False)
            template = rng.choice(pool, self.per_prompt, replace=False)
            for k in range(self.per_prompt):
                is_template = bool(rng.random() < own_share)
                traces.append(int(template[k] if is_template else healthy[k]))
                groups.append(p)
                rewards.append(0.0 if is_template else float(rng.random() < self.success[p]))
        rows = np.array(traces)
        L = c.L_seq[np.ix_(rows, np.asarray(self.prompts))]  # [R, N]
        if mixture:
            # The mixture policy's probability of z under x_j.
            L_T = c.L_seq[rows, c.template_column(self.style)][:, None]
            L = np.logaddexp(math.log1p(-share) + L, math.log(share) + L_T)
        return {
            "row_group_ids": groups,
            "reasoning_lengths": c.lengths[rows].tolist(),
            "L_seq": L.tolist(),
            "token_entropy": [c.entropy[t].tolist() for t in rows],
            "rewards": rewards,
        }
