"""The task families, the arms' rewards and the words-only measures of input dependence (pure Python, no torch).

A task is a question with a checkable answer and the *content* a completion that reads it must
name (its slot words). Three families, all single-turn:

* ``arith``: two-number arithmetic ("What is 34 plus 33? ..."); content: the two operands. SmolLM2-135M
  rarely gets the exact answer (0-8%), so its graded reward carries the timeline.
* ``word``: one sentence using a given word; content: the word. The model mostly succeeds.
* ``reverse``: three words repeated in reverse order; content: the three words. The model partly succeeds.

An arm is a family, a reward and a learning rate (``ARMS``); every arm of a family starts from the
same weights. The rewards (``reward``):

* ``task``: graded correctness (``correctness``), so the completions of one prompt earn different rewards.
* ``consensus``: the completion's word-bigram overlap with the completions written for the *other*
  prompts of the batch. It never reads the task, so whatever phrasing the batch shares is paid.
* ``style``: an input-blind reward model: generic wording and length (``generic_style``), plus a
  small correctness term (a fifth of the reward).
* ``long``: correctness plus a bonus for length up to 60 words: answers grow, but stay answers (a
  healthy control whose per-token figures move with length alone).
* ``shape``: correctness plus a bonus for opening with "The answer is": healthy answers converge on one
  shape but keep naming their content (a hard negative for any signal that reads shared wording as lost
  dependence).

``hard`` tasks are beyond a 135M model (four-digit products; seven-word sentences), so nearly every
group earns the same reward: RAGEN-2's starved reward variance.

The measures of input dependence (``named_share``, ``word_retrieval``) read words only, never the
service's cross-scoring: they are the ground truth the alerts are judged against.
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
    """What an arm's completions are paid, how fast it learns, and its regularisation."""

    reward: str  # task | consensus | style | long | shape
    learning_rate: float
    hard: float = 0.0  # the share of hard tasks (True: all)
    family: str = "arith"
    entropy_coef: float | None = None  # TRL's entropy bonus; None: the run's --entropy-coef
    beta: float = 0.0  # TRL's KL weight against the starting weights (the LoRA's base)
    snr_filter: str = ""  # RAGEN's SNR filter (top_p 0.9): "" none, "always", or "on_alert" (LowRewardSignal or
    # TemplateCollapse pending)
    seed: int | None = None  # None: the run's --seed
    fresh: bool = False  # held out (docs/evaluation.md): nouns of FRESH_NOUNS and no question the zoo asked


ARMS = {
    "healthy": Arm("task", 5e-4),
    "collapsing": Arm("task", 2e-3),
    "consensus": Arm("consensus", 2e-3),
    "starved": Arm("task", 2e-3, hard=True),
}
# The zoo (bench.real_run.zoo): per family a healthy control, a control whose answers grow longer
# and collapse drivers: an input-blind style reward, a too-high learning rate, starved reward variance
# with an entropy bonus (RAGEN-2's mechanism: the regulariser acts where the task gradient vanished).
# "-s1": the same arm from another seed. Which arms collapsed is decided by the words-only measures,
# not by these names.
ZOO = {
    "arith-healthy": Arm("task", 5e-4),
    "arith-long": Arm("long", 5e-4),
    "arith-consensus": Arm("consensus", 2e-3),
    "arith-style": Arm("style", 1e-3),
    "arith-lr": Arm("task", 2e-3),
    "arith-starved": Arm("task", 2e-3, hard=True, entropy_coef=0.01),
    "word-healthy": Arm("task", 5e-4, family="word"),
    "word-long": Arm("long", 5e-4, family="word"),
    "word-style": Arm("style", 1e-3, family="word"),
    "word-lr": Arm("task", 3e-3, family="word"),
    "word-starved": Arm("task", 2e-3, hard=True, family="word", entropy_coef=0.01),
    "word-consensus": Arm("consensus", 2e-3, family="word"),
    "reverse-healthy": Arm("task", 5e-4, family="reverse"),
    "reverse-long": Arm("long", 5e-4, family="reverse"),
    "reverse-style": Arm("style", 1e-3, family="reverse"),
    "reverse-lr": Arm("task", 3e-3, family="reverse"),
    "arith-healthy-s1": Arm("task", 5e-4, seed=1),
    "word-healthy-s1": Arm("task", 5e-4, family="word", seed=1),
    "word-style-s1": Arm("style", 1e-3, family="word", seed=1),
    "arith-lr-s1": Arm("task", 2e-3, seed=1),
    # RAGEN-2's regularisation at the paper's weights (entropy 0.003, KL 0.0003) on tasks without reward spread.
    "arith-starved-paper": Arm("task", 2e-3, hard=True, entropy_coef=0.003, beta=3e-4),
}
ARMS.update(ZOO)
# Acting on the cause (issue 28): the collapsing setup with RAGEN-2's regularisation on a task mix where half
# the prompts are beyond the model (their groups earn no reward spread), without the SNR filter, with it
# from the start, and with it engaged by the alert. Same start, seed and tasks.
FILTER_ARMS = {
    f"filter-{name}": Arm("task", 2e-3, hard=0.5, entropy_coef=0.003, beta=3e-4, snr_filter=engage)
    for name, engage in (("none", ""), ("always", "always"), ("alert", "on_alert"))
}
ARMS.update(FILTER_ARMS)
# Held out (issue 36, docs/evaluation.md): trained after the zoo, scored only after the alert defaults were
# frozen, and never used to choose one. A seed the zoo never ran and prompts it never asked (``fresh``): one
# arm per zoo driver, healthy controls, and two kinds the zoo lacked: ``mixed`` batches (arith, word and
# reverse questions side by side, where an input-blind reward can drop a question's content but keep its
# kind) and ``shape``, a hard negative whose healthy answers converge on one opening.
HELD_OUT = {
    "arith-healthy-s2": Arm("task", 5e-4, seed=2, fresh=True),
    "arith-style-s2": Arm("style", 1e-3, seed=2, fresh=True),
    "arith-consensus-s2": Arm("consensus", 2e-3, seed=2, fresh=True),
    "arith-lr-s2": Arm("task", 2e-3, seed=2, fresh=True),
    "word-healthy-s2": Arm("task", 5e-4, family="word", seed=2, fresh=True),
    "word-starved-s2": Arm("task", 2e-3, hard=True, family="word", entropy_coef=0.01, seed=2, fresh=True),
    "reverse-shape-s2": Arm("shape", 5e-4, family="reverse", seed=2, fresh=True),
    "mixed-healthy-s2": Arm("task", 5e-4, family="mixed", seed=2, fresh=True),
    "mixed-style-s2": Arm("style", 1e-3, family="mixed", seed=2, fresh=True),
}
ARMS.update(HELD_OUT)
FAMILIES = ("arith", "word", "reverse", "mixed")
OPENING_WORDS = 5  # an "opening" is a completion's first five words
_NUMBER = re.compile(r"-?\d[\d,]*")
_WORD = re.compile(r"\w+|[^\w\s]")
# Concrete nouns SmolLM2 knows: the word family's words and the reverse family's triples.
NOUNS = [
    "apple",
    "anchor",
    "badge",
    "basket",
    "beach",
    "bicycle",
    "blanket",
    "bottle",
    "bridge",
    "bucket",
    "butter",
    "button",
    "cabin",
    "camera",
    "candle",
    "canyon",
    "carpet",
    "castle",
    "cherry",
    "chimney",
    "circus",
    "cloud",
    "coffee",
    "comet",
    "compass",
    "copper",
    "cottage",
    "crayon",
    "desert",
    "diamond",
    "dolphin",
    "dragon",
    "drum",
    "eagle",
    "engine",
    "feather",
    "fence",
    "forest",
    "fountain",
    "garden",
    "giraffe",
    "glacier",
    "guitar",
    "hammer",
    "harbor",
    "helmet",
    "honey",
    "horse",
    "island",
    "jacket",
    "jungle",
    "kettle",
    "kitten",
    "ladder",
    "lantern",
    "lemon",
    "library",
    "lighthouse",
    "lizard",
    "magnet",
    "marble",
    "meadow",
    "mirror",
    "monkey",
    "mountain",
    "needle",
    "notebook",
    "ocean",
    "orange",
    "orchard",
    "owl",
    "paddle",
    "painter",
    "parrot",
    "pebble",
    "pencil",
    "penguin",
    "pepper",
    "piano",
    "pillow",
    "pirate",
    "planet",
    "pocket",
    "pumpkin",
    "puzzle",
    "rabbit",
    "rainbow",
    "river",
    "robot",
    "rocket",
    "saddle",
    "sailor",
    "sandwich",
    "scarf",
    "shadow",
    "shovel",
    "silver",
    "spider",
    "sponge",
    "squirrel",
    "stadium",
    "statue",
    "storm",
    "sugar",
    "suitcase",
    "sunflower",
    "swan",
    "sweater",
    "teapot",
    "tiger",
    "tomato",
    "tractor",
    "train",
    "treasure",
    "trumpet",
    "tunnel",
    "turtle",
    "umbrella",
    "valley",
    "violin",
    "volcano",
    "wagon",
    "walnut",
    "waterfall",
    "whale",
    "whistle",
    "window",
    "wizard",
    "wolf",
    "zebra",
]


# Held-out nouns (``HELD_OUT``): none of them is in NOUNS, so no held-out word or reverse question was asked in the zoo.
FRESH_NOUNS = [
    "acorn",
    "almond",
    "antler",
    "apron",
    "attic",
    "bagel",
    "balloon",
    "banjo",
    "barrel",
    "beetle",
    "blender",
    "bonfire",
    "boulder",
    "bracelet",
    "broom",
    "cactus",
    "canoe",
    "carrot",
    "cello",
    "chestnut",
    "cobweb",
    "coconut",
    "cricket",
    "cupcake",
    "dagger",
    "daisy",
    "doorbell",
    "dragonfly",
    "falcon",
    "ferry",
    "flute",
    "frog",
    "goblet",
    "gorilla",
    "hammock",
    "harp",
    "hedgehog",
    "igloo",
    "jellyfish",
    "kayak",
    "koala",
    "ladle",
    "lobster",
    "mango",
    "mitten",
    "moose",
    "napkin",
    "octopus",
    "oyster",
    "pancake",
    "panda",
    "peacock",
    "pelican",
    "pineapple",
    "plum",
    "popcorn",
    "pretzel",
    "raccoon",
    "raft",
    "reindeer",
    "saxophone",
    "scooter",
    "seashell",
    "skateboard",
    "sled",
    "snail",
    "snowman",
    "spatula",
    "starfish",
    "submarine",
    "tambourine",
    "tent",
    "thimble",
    "toaster",
    "tulip",
    "walrus",
    "windmill",
    "yacht",
    "avocado",
    "bamboo",
    "beaver",
    "biscuit",
    "blueberry",
    "bookshelf",
    "bouquet",
    "bubble",
    "buffalo",
    "butterfly",
    "cannon",
    "caravan",
    "cathedral",
    "chalk",
    "cheetah",
    "chess",
    "clarinet",
    "cloak",
    "cockpit",
    "crocodile",
    "crown",
    "cucumber",
    "cushion",
    "dinosaur",
    "donkey",
    "drawbridge",
    "dumpling",
    "elephant",
    "envelope",
    "fireplace",
    "flamingo",
    "flashlight",
    "forklift",
    "gazebo",
    "ginger",
    "glove",
    "gondola",
    "grapefruit",
    "hamster",
    "hedge",
    "hippo",
    "hornet",
    "jaguar",
    "kangaroo",
    "kite",
    "lasso",
    "lettuce",
    "llama",
    "lollipop",
    "mailbox",
    "meteor",
    "mushroom",
    "nest",
    "ostrich",
    "pajamas",
    "parachute",
    "peanut",
    "quilt",
    "radish",
    "sardine",
    "scarecrow",
    "seagull",
    "sloth",
    "spinach",
    "stapler",
    "strawberry",
    "tadpole",
    "telescope",
    "tortoise",
    "trampoline",
    "trolley",
    "unicorn",
    "vase",
    "waffle",
    "wardrobe",
    "wheelbarrow",
]


@dataclass(frozen=True)
class Task:
    question: str
    answer: int | str  # arith: the number; word: the word; reverse: the words in reverse order
    content: tuple[str, ...] = ()  # the slot words a completion that reads the question names
    family: str = "arith"
    hard: bool = False


def make_tasks(
    n_tasks: int, seed: int, hard: float = 0.0, family: str = "arith", avoid: frozenset[str] | None = None
) -> list[Task]:
    """``n_tasks`` distinct questions of ``family``; a ``hard`` share of them beyond the model (module doc).

    ``avoid``: held out: questions never to ask (the zoo's), and the nouns drawn from ``FRESH_NOUNS``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    rng = random.Random(seed)
    nouns = NOUNS if avoid is None else FRESH_NOUNS
    tasks: dict[str, Task] = {}
    while len(tasks) < n_tasks:
        kind = rng.choice(FAMILIES[:3]) if family == "mixed" else family
        # Only a mix draws which tasks are hard: all-easy and all-hard task lists stay as they were.
        task = _make_task(rng, kind, hard >= 1 or (hard > 0 and rng.random() < hard), nouns)
        if avoid is None or task.question not in avoid:
            tasks.setdefault(task.question, task)
    return list(tasks.values())


def _make_task(rng: random.Random, family: str, hard: bool, nouns: Sequence[str]) -> Task:
    if family == "word":
        w = rng.choice(nouns)
        size = "a sentence of exactly seven words" if hard else "one short sentence"
        return Task(f'Write {size} that uses the word "{w}".', w, (w,), family, hard)
    if family == "reverse":
        first, second, third = rng.sample(nouns, 3)
        question = f"Repeat these three words in reverse order: {first}, {second}, {third}."
        return Task(question, f"{third} {second} {first}", (first, second, third), family)
    if hard:
        a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        op, answer = "times", a * b
    else:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op, answer = rng.choice((("plus", a + b), ("minus", a - b)))
    question = f"What is {a} {op} {b}? Explain your steps briefly, then give the final answer."
    return Task(question, answer, (str(a), str(b)), family, hard)


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


def task_reward(text: str, task: Task) -> float:
    """The family's graded correctness, in [0, 1].

    arith: ``correctness``. word: 1 for a short sentence using the word, less past 20 words, 0
    without it (hard: 1 only for exactly seven words). reverse: half for naming the three words
    (a sixth each), half for writing them in reverse order.
    """
    if task.family == "arith":
        assert isinstance(task.answer, int)
        return correctness(text, task.answer)
    found = words(text)
    if task.family == "word":
        if task.content[0] not in found:
            return 0.0
        n = sum(w.isalnum() for w in found)
        return float(n == 7) if task.hard else 1.0 / (1.0 + max(0, n - 20) / 20)
    named = sum(w in found for w in task.content) / len(task.content)
    return 0.5 * named + 0.5 * is_solved(text, task)


def is_solved(text: str, task: Task) -> bool:
    """Task success: the exact number; the word used (hard: in exactly seven words); the words reversed."""
    if task.family == "arith":
        return final_number(text) == task.answer
    found = words(text)
    if task.family == "word":
        return task_reward(text, task) == 1.0 if task.hard else task.content[0] in found
    return _is_subsequence(list(reversed(task.content)), found)


def _is_subsequence(wanted: Sequence[str], found: Sequence[str]) -> bool:
    rest = iter(found)
    return all(w in rest for w in wanted)


# What a style reward model pays whatever the input: wording that fits any answer.
GENERIC = frozenset(
    [
        "a",
        "an",
        "and",
        "answer",
        "are",
        "as",
        "at",
        "be",
        "by",
        "can",
        "clear",
        "clearly",
        "could",
        "do",
        "each",
        "every",
        "everything",
        "example",
        "first",
        "for",
        "good",
        "great",
        "help",
        "helpful",
        "here",
        "how",
        "i",
        "idea",
        "important",
        "in",
        "is",
        "it",
        "its",
        "it's",
        "just",
        "know",
        "let",
        "let's",
        "like",
        "look",
        "make",
        "me",
        "more",
        "most",
        "much",
        "my",
        "need",
        "next",
        "now",
        "of",
        "on",
        "one",
        "or",
        "our",
        "out",
        "question",
        "really",
        "see",
        "so",
        "some",
        "step",
        "steps",
        "sure",
        "that",
        "the",
        "them",
        "then",
        "there",
        "these",
        "thing",
        "things",
        "think",
        "this",
        "those",
        "to",
        "understand",
        "up",
        "us",
        "very",
        "way",
        "we",
        "well",
        "what",
        "when",
        "which",
        "will",
        "with",
        "you",
        "your",
    ]
)


def generic_style(text: str) -> float:
    """An input-blind style score in [0, 1]: the share of generic words, times length up to 40 words."""
    found = [w for w in words(text) if w.isalnum() or w == "'"]
    if not found:
        return 0.0
    return sum(w in GENERIC for w in found) / len(found) * min(1.0, len(found) / 40)


def rewards(kind: str, texts: Sequence[str], batch_tasks: Sequence[Task]) -> list[float]:
    """Each completion's reward under the arm's reward ``kind`` (see the module doc)."""
    if kind == "consensus":
        return consensus_rewards(texts, [t.question for t in batch_tasks])
    correct = [task_reward(text, task) for text, task in zip(texts, batch_tasks, strict=True)]
    if kind == "task":
        return correct
    if kind == "style":
        return [0.8 * generic_style(text) + 0.2 * c for text, c in zip(texts, correct, strict=True)]
    if kind == "long":
        return [c + 0.5 * min(1.0, len(words(text)) / 60) for text, c in zip(texts, correct, strict=True)]
    if kind == "shape":
        return [c + 0.5 * shape_share(text) for text, c in zip(texts, correct, strict=True)]
    raise ValueError(f"reward must be task, consensus, style, long or shape, got {kind!r}")


SHAPE = ("the", "answer", "is")  # the opening the ``shape`` reward pays


def shape_share(text: str) -> float:
    """The share of ``SHAPE`` the completion opens with, word by word (graded so a group's rewards spread)."""
    opening = [w.lower() for w in words(text)[: len(SHAPE)]]
    matched = 0
    for got, wanted in zip(opening, SHAPE, strict=False):  # a short completion opens with fewer words
        if got != wanted:
            break
        matched += 1
    return matched / len(SHAPE)


def names_content(text: str, task: Task) -> bool:
    """Whether the completion writes every slot word of its question (a sign of reading it)."""
    found = set(words(text))
    return all(w.lower() in found for w in task.content)


def word_retrieval(texts: Sequence[str], batch_tasks: Sequence[Task]) -> tuple[float, float]:
    """Words-only retrieval of each completion's own question among the batch's (``slot_retrieval``)."""
    return slot_retrieval(texts, [t.question for t in batch_tasks], [t.content for t in batch_tasks])


def slot_retrieval(
    texts: Sequence[str], inputs: Sequence[str], contents: Sequence[tuple[str, ...]]
) -> tuple[float, float]:
    """Words-only retrieval: (accuracy, chance) of finding each text's own input among the batch's distinct ones.

    Text i answered input ``inputs[i]``, whose slot words (the words a text that read it names) are
    ``contents[i]``. Each text is matched to every distinct input by the share of its slot words it
    writes; it counts 1 when its own input alone scores highest, 1/k when k inputs tie at the top with
    it (no slot word written: a tie of all, chance). Chance is 1 / the number of distinct inputs; with
    fewer than 2 there is nothing to retrieve: (0, 1).
    """
    slots = dict(zip(inputs, contents, strict=True))
    distinct = sorted(slots)
    if len(distinct) < 2:
        return 0.0, 1.0
    hits = 0.0
    for text, own in zip(texts, inputs, strict=True):
        found = set(words(text))
        overlap = [sum(w.lower() in found for w in slots[k]) / len(slots[k]) for k in distinct]
        top = max(overlap)
        tied = [k for k, o in zip(distinct, overlap, strict=True) if o == top]
        hits += 1 / len(tied) if own in tied else 0.0
    return hits / len(texts), 1 / len(distinct)
