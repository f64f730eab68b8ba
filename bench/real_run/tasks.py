"""The task family, the arms' rewards and the text measures of templating (pure Python, no torch).

The tasks are two-number arithmetic questions with a checkable integer answer. An arm is a reward
and a learning rate (``ARMS``); all start from the same weights and seed:

* ``healthy``: the task reward, graded correctness of the final number (1 when exact, less the
  further it is off), so the completions of one prompt earn different rewards, at lr 5e-4.
* ``collapsing``: the same task reward at 4x the learning rate. Nothing of ours in the text: the
  policy's guesses soon all miss by about as much, the rewards stop varying within groups
  (RAGEN-2's mechanism, reward variance starved) and the completions stop reading the question.
* ``consensus``: the completion's word-bigram overlap with the completions written for the *other*
  prompts of the batch. It never reads the task, so whatever phrasing the batch shares is paid.
* ``starved``: RAGEN-2's mechanism by design. Correctness only on questions far beyond a 135M model
  (four-digit products), so nearly every group earns the same reward and its advantage is zero.

The text measures are independent of the service's cross-scoring: they read words only.
"""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Arm:
    """What an arm's completions are paid (``task`` correctness or ``consensus``) and how fast it learns."""

    reward: str
    learning_rate: float
    hard: bool = False  # four-digit products instead of two-digit sums and differences


ARMS = {
    "healthy": Arm("task", 5e-4),
    "collapsing": Arm("task", 2e-3),
    "consensus": Arm("consensus", 2e-3),
    "starved": Arm("task", 2e-3, hard=True),
}
OPENING_WORDS = 5  # an "opening" is a completion's first five words
_NUMBER = re.compile(r"-?\d[\d,]*")
_WORD = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class Task:
    question: str
    answer: int


def make_tasks(n_tasks: int, seed: int, hard: bool = False) -> list[Task]:
    """``n_tasks`` distinct arithmetic questions; ``hard`` ones are four-digit products."""
    rng = random.Random(seed)
    tasks: dict[str, Task] = {}
    while len(tasks) < n_tasks:
        if hard:
            a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
            op, answer = "times", a * b
        else:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            op, answer = rng.choice((("plus", a + b), ("minus", a - b)))
        question = f"What is {a} {op} {b}? Explain your steps briefly, then give the final answer."
        tasks[question] = Task(question, answer)
    return list(tasks.values())


def final_number(text: str) -> int | None:
    """The last integer written in ``text`` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "")
    return int(digits) if digits not in ("", "-") else None


def correctness(text: str, answer: int) -> float:
    """1 for the exact answer, ``1 / (1 + |error| / 10)`` for a near miss, 0 without a number.

    Graded so the completions of one prompt rarely all earn the same reward.
    """
    value = final_number(text)
    if value is None:
        return 0.0
    return 1.0 / (1.0 + abs(value - answer) / 10.0)


def is_correct(text: str, answer: int) -> bool:
    return final_number(text) == answer


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    tokens = words(text)
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def jaccard(a: set[tuple[str, ...]], b: set[tuple[str, ...]]) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def consensus_rewards(texts: Sequence[str], prompt_keys: Sequence[str]) -> list[float]:
    """Each completion's mean word-bigram Jaccard overlap with the completions of other prompts."""
    grams = [_ngrams(t, 2) for t in texts]
    rewards = []
    for i, key in enumerate(prompt_keys):
        others = [jaccard(grams[i], grams[j]) for j, other in enumerate(prompt_keys) if other != key]
        rewards.append(sum(others) / len(others) if others else 0.0)
    return rewards


def opening(text: str, mask_numbers: bool = False) -> str:
    found = words(text)[:OPENING_WORDS]
    return " ".join("#" if mask_numbers and w.isdigit() else w for w in found)


def opening_share(texts: Sequence[str], mask_numbers: bool = False) -> tuple[float, str]:
    """The share of completions that open with the most common opening, and that opening.

    With ``mask_numbers`` every number reads ``#``: a fill-in-the-numbers template ("to calculate
    # + #") counts as one opening, although its numbers still follow the input.
    """
    if not texts:
        return 0.0, ""
    common, count = Counter(opening(t, mask_numbers) for t in texts).most_common(1)[0]
    return count / len(texts), common


def cross_prompt_overlap(texts: Sequence[str], prompt_keys: Sequence[str], n: int = 3) -> float:
    """Mean word-trigram Jaccard overlap over pairs of completions of different prompts."""
    grams = [_ngrams(t, n) for t in texts]
    pairs = [
        jaccard(grams[i], grams[j])
        for i, j in itertools.combinations(range(len(texts)), 2)
        if prompt_keys[i] != prompt_keys[j]
    ]
    return sum(pairs) / len(pairs) if pairs else 0.0


def mentions_operands(text: str, question: str) -> bool:
    """Whether the completion writes both numbers of its question (a crude sign of reading it)."""
    operands = _NUMBER.findall(question)
    return all(o in text for o in operands)
