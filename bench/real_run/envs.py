"""Multi-turn environments for agent RL (issue 36), their rewards and the words-only measures per turn.

Pure Python, no torch. An episode is a conversation: the environment's observation, the agent's
reply, the next observation (which depends on the reply), and so on, for at least three turns. In
both environments each turn's observation changes and the right reply depends on it, as in RAGEN's
FrozenLake and Sokoban, at a size SmolLM2-135M partly solves:

* ``rooms``: find an object in a house. Each turn names the room the agent stands in, three doors
  and a note saying which door leads on; the agent answers with a room. The right door moves it on
  (three moves reach the object); a wrong one is a dead end and sends it back. Four turns at most.
* ``shop``: spend a purse. Each turn names the coins the agent holds and two items with their prices,
  one it can afford; the agent answers with the item it buys. Buying what it can afford spends the
  price (so the next turn's offer depends on the reply); the other is refused and nothing is spent.
  Three offers; two purchases solve the episode.

A third environment, ``reverse``, is one turn: the zoo's reverse task (repeat three words in reverse
order), where a ``hard`` start hides the words, so nothing can solve it and its group's rewards spread
only by the input-blind term of the ``remedy`` reward: the low-SNR pressure of RAGEN-2's remedy trial
(``REMEDY_ARMS``).

Each turn has *content*: the slot words a reply that reads that observation names (the doors of
``rooms``; the two items of ``shop``). ``turn_retrieval`` matches every reply
of turn k to the batch's observations of turn k by those words: the words-only ground truth per
turn, which never reads the service's cross-scoring.

Rewards (an arm's ``reward``): ``task`` is the episode's graded progress (``Episode.task_reward``: the
share of the moves made, or of the purchases made; on a ``hard`` start only a solved episode earns);
``blind`` an input-blind reward model that pays each reply's generic wording and length whatever it
answers (plus a fifth of the task reward); ``long`` the task reward plus a bonus for longer replies (a
healthy control whose turns grow longer).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.real_run import tasks
from bench.real_run.tasks import GENERIC, slot_retrieval, words

ENVS = ("rooms", "shop")  # the multi-turn ones; "reverse" is the remedy trial's single turn
ROOMS = [
    "kitchen",
    "cellar",
    "library",
    "garden",
    "attic",
    "hallway",
    "bedroom",
    "bathroom",
    "study",
    "pantry",
    "garage",
    "balcony",
    "nursery",
    "chapel",
    "workshop",
    "greenhouse",
    "ballroom",
    "laundry",
    "armory",
    "gallery",
]
OBJECTS = ["key", "map", "lamp", "coin", "ring", "book", "hat", "clock", "cup", "flute"]
ITEMS = [
    "apple",
    "bread",
    "candle",
    "rope",
    "shovel",
    "lamp",
    "blanket",
    "kettle",
    "hammer",
    "basket",
    "ladder",
    "bucket",
    "mirror",
    "pillow",
    "compass",
    "lantern",
    "saddle",
    "cheese",
    "teapot",
    "violin",
    "helmet",
    "jacket",
    "saucepan",
    "umbrella",
    "scarf",
    "needle",
    "barrel",
]
MOVES = 3  # rooms: the moves that reach the object
ROOM_TURNS = 4  # rooms: turns at most (one wrong door can be recovered from)
OFFERS = 3  # shop: turns, one offer each
PURCHASES = 2  # shop: the purchases that solve an episode (SmolLM2 buys on about a quarter of its turns)

ROOMS_INTRO = (
    "You are exploring a house to find the {object}. Each turn, answer with the name of the room you walk into."
)
SHOP_INTRO = "You are at a market with a purse of coins. Each turn, answer with the item you buy."


@dataclass(frozen=True)
class Start:
    """An episode's initial state: what the episodes of one prompt group share."""

    env: str
    seed: int
    # rooms: the path (MOVES + 1 rooms, the first where the agent starts) and each stop's two decoys;
    # shop: the starting coins
    path: tuple[str, ...] = ()
    decoys: tuple[tuple[str, str], ...] = ()
    target: str = ""
    coins: int = 0
    hard: bool = False  # starved: no note (rooms), no prices (shop), three choices; reward only for a solved episode


def make_starts(env: str, n: int, seed: int, hard: bool = False) -> list[Start]:
    """``n`` distinct initial states of ``env``, drawn from ``seed``."""
    if env not in (*ENVS, "reverse"):
        raise ValueError(f"env must be one of {', '.join(ENVS)}, reverse, got {env!r}")
    rng = random.Random(seed)
    starts: dict[tuple[object, ...], Start] = {}
    while len(starts) < n:
        if env == "rooms":
            start = _rooms_start(rng, hard)
        elif env == "reverse":
            words = tuple(rng.sample(tasks.NOUNS, 3))
            start = Start("reverse", rng.randrange(2**31), path=words, hard=hard and rng.random() < 0.5)
        else:
            start = Start("shop", rng.randrange(2**31), coins=rng.randint(6, 12), hard=hard)
        starts.setdefault((start.path, start.decoys, start.target, start.coins, start.seed), start)
    return list(starts.values())


def _rooms_start(rng: random.Random, hard: bool) -> Start:
    chosen = rng.sample(ROOMS, MOVES + 1 + 2 * MOVES)
    path, rest = tuple(chosen[: MOVES + 1]), chosen[MOVES + 1 :]
    decoys = tuple((rest[2 * i], rest[2 * i + 1]) for i in range(MOVES))
    return Start("rooms", rng.randrange(2**31), path=path, decoys=decoys, target=rng.choice(OBJECTS), hard=hard)


@dataclass
class Episode:
    """One agent's episode from a ``Start``: observations in, replies out, until ``done``."""

    start: Start
    turn: int = 0  # replies taken so far
    position: int = 0  # rooms: index on the path; shop: offers made
    held: int = 0  # shop: the coins in the purse
    correct: list[bool] = field(default_factory=list)  # per reply: the right door / an item it could afford
    done: bool = False
    contents: list[tuple[str, ...]] = field(default_factory=list)  # per observation: its slot words
    opening: str = ""  # the first observation
    reward_of_task: float = 0.0  # reverse: tasks.task_reward of the reply (0 on a hidden start)

    def __post_init__(self) -> None:
        self.held = self.start.coins
        if self.start.env == "reverse":
            self.contents.append(self.start.path)
            self.opening = self._reverse_task().question
        elif self.start.env == "rooms":
            intro = ROOMS_INTRO.format(object=self.start.target)
            self.opening = f"{intro}\n{self._room_view()}"
        else:
            self.opening = f"{SHOP_INTRO}\n{self._offer()}"

    def step(self, reply: str) -> str | None:
        """Takes the agent's reply; the next observation, or None when the episode is over."""
        self.turn += 1
        if self.start.env == "reverse":
            self.correct.append(not self.start.hard and tasks.is_solved(reply, self._reverse_task()))
            self.reward_of_task = 0.0 if self.start.hard else tasks.task_reward(reply, self._reverse_task())
            self.done = True
            return None
        if self.start.env == "rooms":
            return self._rooms_step(reply)
        return self._shop_step(reply)

    # reverse
    def _reverse_task(self) -> tasks.Task:
        first, second, third = self.start.path
        if self.start.hard:  # the words are never shown: no reply can be right
            question = "Repeat, in reverse order, the three words I whispered to you before this conversation."
        else:
            question = f"Repeat these three words in reverse order: {first}, {second}, {third}."
        return tasks.Task(question, f"{third} {second} {first}", self.start.path, "reverse", self.start.hard)

    # rooms
    def _doors(self) -> list[str]:
        here = self.position
        doors = [self.start.path[here + 1], *self.start.decoys[here]]
        random.Random(self.start.seed + here).shuffle(doors)
        return doors

    def _room_view(self) -> str:
        room, doors = self.start.path[self.position], self._doors()
        self.contents.append(tuple(doors))
        nxt = self.start.path[self.position + 1]
        note = "" if self.start.hard else f"A note says: the {self.start.target} is reached through the {nxt}. "
        return (
            f"You are in the {room}. Doors lead to the {doors[0]}, the {doors[1]} and the {doors[2]}. "
            f"{note}Which room do you walk into?"
        )

    def _rooms_step(self, reply: str) -> str | None:
        doors = self._doors()
        chosen = first_named(reply, doors)
        right = chosen == self.start.path[self.position + 1]
        self.correct.append(right)
        if right:
            self.position += 1
            if self.position == MOVES:
                self.done = True
                return None
        if self.turn >= ROOM_TURNS:
            self.done = True
            return None
        if right:
            return self._room_view()
        went = f"the {chosen}" if chosen else "nowhere"
        return f"You walked into {went}: a dead end, so you go back. " + self._room_view()

    # shop
    def _items(self) -> list[tuple[str, int]]:
        """This turn's offer: (item, price) pairs, one affordable; the same state always gets the same offer."""
        rng = random.Random(f"{self.start.seed}/{self.position}/{self.held}")
        names = rng.sample(ITEMS, 3 if self.start.hard else 2)
        # One price within the purse (leaving a coin for later), the others beyond it.
        cheap = rng.randint(1, max(1, min(4, self.held - (OFFERS - self.position))))
        offer = [(names[0], cheap), *((n, self.held + rng.randint(1, 6)) for n in names[1:])]
        rng.shuffle(offer)
        return offer

    def _offer(self) -> str:
        offer = self._items()
        self.contents.append(tuple(name for name, _ in offer))
        names = [name for name, _ in offer]
        question = f"Which do you buy, the {', the '.join(names[:-1])} or the {names[-1]}?"
        if self.start.hard:
            return f"You hold {self.held} coins. {question}"
        listed = " and ".join(f"a {name} for {price} coins" for name, price in offer)
        return f"You hold {self.held} coins. The stall sells {listed}. {question}"

    def _shop_step(self, reply: str) -> str | None:
        offer = dict(self._items())
        chosen = first_named(reply, list(offer))
        right = bool(chosen) and offer[chosen] <= self.held
        self.correct.append(right)
        if right:
            self.held -= offer[chosen]
        self.position += 1
        if self.position == OFFERS:
            self.done = True
            return None
        if right:
            verdict = f"You bought the {chosen}."
        elif chosen:
            verdict = f"You cannot afford the {chosen}."
        else:
            verdict = "You bought nothing."
        return f"{verdict} {self._offer()}"

    @property
    def is_solved(self) -> bool:
        """rooms: the object found; shop: ``PURCHASES`` items bought (on a hard start, one every offer);
        reverse: the words reversed."""
        if self.start.env == "reverse":
            return bool(self.correct) and self.correct[0]
        if self.start.env == "rooms":
            return self.position == MOVES
        return sum(self.correct) >= (OFFERS if self.start.hard else PURCHASES)

    def task_reward(self) -> float:
        """The episode's graded progress in [0, 1]: the share of moves made (rooms) or of offers bought (shop);
        on a hard start only a solved episode earns (1), so nearly every group's rewards are all 0."""
        if self.start.env == "reverse":
            return self.reward_of_task
        if self.start.hard:
            return float(self.is_solved)
        if self.start.env == "rooms":
            return self.position / MOVES
        return sum(self.correct) / OFFERS


@dataclass(frozen=True)
class AgentArm:
    """A multi-turn arm: the environment, what its episodes are paid, how fast it learns."""

    env: str
    reward: str  # task | blind | long
    learning_rate: float
    hard: bool = False  # starved reward variance (``Start.hard``)
    entropy_coef: float = 0.0
    seed: int = 0


# Per environment the drivers of issue 36: a healthy control, a healthy control whose turns grow longer,
# an input-blind reward, a too-high learning rate and starved reward variance with an entropy bonus (the
# zoo's); two seeds each. All held out: none is scored before the alert defaults are frozen.
AGENT_ARMS = {
    f"{env}-{driver}-s{seed}": AgentArm(env, reward, lr, hard, entropy, seed)
    for env in ENVS
    for driver, reward, lr, hard, entropy in (
        ("healthy", "task", 5e-4, False, 0.0),
        ("long", "long", 5e-4, False, 0.0),
        ("blind", "blind", 1e-3, False, 0.0),
        ("lr", "task", 3e-3, False, 0.0),
        ("starved", "task", 2e-3, True, 0.01),
    )
    for seed in (0, 1)
}


@dataclass(frozen=True)
class RemedyArm:
    """An arm of the remedy trial: which groups each step trains on (``agent.FILTERS``) and the seed."""

    filter: str
    seed: int


# The remedy trial (issue 36, item 4): the reverse task with half its prompts hidden (low SNR), paired on
# seeds: no filter, RAGEN's top_p 0.9 in its linear and softmax modes (the paper ran softmax), dropping only
# zero-spread groups (DAPO), advantages not divided by the group's std (the mechanism control), and the
# linear filter (SNRFilter's default) engaged by TemplateCollapse firing, scored as the service scores it,
# every step.
REMEDY = AgentArm("reverse", "remedy", 1e-3, hard=True, entropy_coef=0.003)
REMEDY_FILTERS = ("none", "ragen-linear", "ragen-softmax", "dapo", "unscaled", "on-alert")
# Seeds 3 and 4 (2026-12-07) because the same seed trained twice moved final success by 0.6 (docs/evaluation.md):
# 3 seeds cannot separate the filters' paired differences from that, and a sign test over 5 can reach 0.0625.
REMEDY_ARMS = {f"remedy-{f}-s{seed}": RemedyArm(f, seed) for seed in range(5) for f in REMEDY_FILTERS}


def first_named(reply: str, options: Sequence[str]) -> str:
    """The option the reply names first ('' when it names none)."""
    found = [w.lower() for w in words(reply)]
    positions = [(found.index(o), o) for o in options if o in found]
    return min(positions)[1] if positions else ""


def generic_share(reply: str) -> float:
    """An input-blind style score in [0, 1]: the share of generic words, times length up to 30 words."""
    found = [w for w in words(reply) if w.isalnum()]
    if not found:
        return 0.0
    return sum(w in GENERIC for w in found) / len(found) * min(1.0, len(found) / 30)


def episode_reward(kind: str, episode: Episode, replies: Sequence[str]) -> float:
    """An episode's reward under the arm's reward ``kind`` (module docstring)."""
    task = episode.task_reward()
    if kind == "task":
        return task
    if kind == "blind":
        return 0.8 * sum(generic_share(r) for r in replies) / max(len(replies), 1) + 0.2 * task
    if kind == "long":
        mean_words = sum(len(words(r)) for r in replies) / max(len(replies), 1)
        return task + 0.5 * min(1.0, mean_words / 20)  # replies are 32 tokens at most
    if kind == "remedy":  # the task, plus a small input-blind term: a hidden start's group spreads by it alone
        return task + 0.05 * sum(generic_share(r) for r in replies) / max(len(replies), 1)
    raise ValueError(f"reward must be task, blind, long or remedy, got {kind!r}")


def turn_retrieval(
    replies: Sequence[str], observations: Sequence[str], contents: Sequence[tuple[str, ...]]
) -> tuple[float, float]:
    """Words-only retrieval of one turn index: (accuracy, chance) of each reply's own observation among the
    batch's distinct observations of that turn, matched by their slot words (``tasks.slot_retrieval``)."""
    return slot_retrieval(replies, observations, contents)
