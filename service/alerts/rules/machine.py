"""What every rule shares: the episode it reports, the resumable state machine, and the rule's contract.

    condition holds ──▶ pending ──(holds `window` consecutive steps)──▶ firing
    pending ──(condition fails)──▶ dropped (never fired: kept as a record, nothing is notified)
    firing ──(condition fails `resolve_window` consecutive steps)──▶ resolved

A rule reads one row per step (a typed ``Row`` of the figures it needs) and keeps everything it
knows in a ``Machine`` (the state machine's open episode, its streaks, the baselines' first values,
the rows waiting for them) plus, where it needs more, a state of its own (``Rule.State``). Both are
plain values: a replay's state is stored as JSON and resumed from. Pure: must not import fastapi
or touch the database.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from service.schemas.alerts import AlertSettings, AlertState, RuleName, Severity

Series = dict[str, list[tuple[int, float]]]  # stored name -> [(step, value)], ascending steps
Records = list[tuple[int, dict[str, float]]]  # per step (ascending), the value of each series there


@dataclass(frozen=True)
class Episode:
    """One alert of one rule: when it began, fired and resolved, and the figures behind it."""

    rule: RuleName
    severity: Severity
    sampler: str
    state: AlertState
    onset_step: int
    fired_step: int | None
    resolved_step: int | None
    last_step: int
    value: float
    baseline: float
    threshold: float
    summary: str
    description: str


@dataclass(frozen=True)
class Span:
    """Where one episode lies on the step axis, as the state machine found it, and the rows it spans."""

    onset: int
    fired: int | None
    resolved: int | None
    last: int
    n_rows: int  # the rule's rows from the onset to the last step, both included
    n_held: int  # ... of which the condition held
    is_dropped: bool = False  # a pending episode whose condition broke before it fired (last: its last held step)

    @property
    def state(self) -> AlertState:
        if self.is_dropped:
            return "dropped"
        return "resolved" if self.resolved is not None else "firing" if self.fired is not None else "pending"


@dataclass(frozen=True)
class Figures:
    """What an episode reports at its last step."""

    value: float
    baseline: float
    threshold: float
    summary: str
    description: str


class Rewind(Exception):
    """New points change how earlier steps are judged (a series the rules confirm with appeared late), or a
    saved state cannot be resumed (it lacks a rule, or a rule's state changed shape): the history must be
    replayed from its start."""


@dataclass
class Machine:
    """One rule's resumable state: the state machine's open episode, its streaks, the newest row.

    The state machine over a rule's rows (one per step, ascending):

        firing: a row the condition misses counts towards ``resolve_window``; enough in a row resolve it
        otherwise: a row the condition holds opens (or continues) a pending episode, which fires on a
        row where it held long enough (``ready``); a row it misses drops a pending episode

    ``pending`` holds rows that arrived before the rule's baselines existed (fewer than
    ``baseline_steps`` of them, so at most that many): once they exist they are judged in order.
    Rows are kept as the rule's ``Row`` fields (``dict``): the state is stored as JSON.
    """

    onset: int | None = None
    fired: int | None = None
    clear: int = 0
    n_rows: int = 0
    n_held: int = 0
    streaks: list[int] = field(default_factory=lambda: [0, 0])
    latest: int | None = None  # step of the rule's newest row
    latest_row: dict[str, Any] | None = None
    held: dict[str, Any] | None = None  # the pending episode's newest row, told if the episode drops
    tail: dict[str, Any] | None = None  # the episode resolved at the newest row (re-described while it is)
    heads: dict[str, list[float]] = field(default_factory=dict)  # first baseline_steps values per series
    pending: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    def head(self, name: str, value: float, config: AlertSettings) -> None:
        values = self.heads.setdefault(name, [])
        if len(values) < config.baseline_steps:
            values.append(value)

    def baseline(self, name: str, config: AlertSettings) -> float | None:
        values = self.heads.get(name, [])
        return statistics.median(values) if len(values) >= config.baseline_steps else None

    def advance(
        self, step: int, hold: bool, ready: bool, row: dict[str, Any], resolve_window: int
    ) -> tuple[Span | None, tuple[Span, dict[str, Any]] | None]:
        """One row through the state machine: (the episode it resolved, the pending one it dropped with its
        last held row)."""
        previous, self.latest, self.latest_row = self.latest, step, row
        if self.onset is not None and self.fired is not None:
            self.n_rows, self.n_held = self.n_rows + 1, self.n_held + hold
            self.clear = 0 if hold else self.clear + 1
            if self.clear < resolve_window:
                return None, None
            span = Span(self.onset, self.fired, step, step, self.n_rows, self.n_held)
            self.onset, self.fired, self.clear = None, None, 0
            return span, None
        if hold:
            if self.onset is None:
                self.onset, self.n_rows, self.n_held = step, 0, 0
            self.n_rows, self.n_held = self.n_rows + 1, self.n_held + 1
            self.held = row
            if ready:
                self.fired, self.held = step, None
            return None, None
        if self.onset is None or self.held is None or previous is None:
            return None, None
        span = Span(self.onset, None, None, previous, self.n_rows, self.n_held, is_dropped=True)
        dropped, self.onset, self.held = (span, self.held), None, None
        return None, dropped

    def open_span(self) -> Span | None:
        if self.onset is None or self.latest is None:
            return None
        return Span(self.onset, self.fired, None, self.latest, self.n_rows, self.n_held)


@dataclass
class NoState:
    """The state of a rule that needs nothing beyond its Machine."""


if TYPE_CHECKING:
    from _typeshed import DataclassInstance
RowT = TypeVar("RowT", bound="DataclassInstance")
StateT = TypeVar("StateT", bound="DataclassInstance")


class Rule(Generic[RowT, StateT]):
    """A rule over the per-step records of one (run, sampler): which rows it reads, judges and describes.

    A rule class names its ``Row`` (a frozen dataclass of the figures one row carries) and its
    ``State`` (a dataclass of what it keeps beyond the Machine; ``NoState`` when nothing).
    """

    name: ClassVar[RuleName]
    severity: ClassVar[Severity]
    advice: ClassVar[str]
    Row: type[RowT]
    State: type[StateT]

    def __init__(self, run: str, sampler: str, config: AlertSettings, saved: dict[str, Any] | None = None) -> None:
        self.run, self.sampler, self.config = run, sampler, config
        self.m, self.s = self._restore(saved)

    @staticmethod
    def needs(config: AlertSettings) -> tuple[str, ...]:
        """The stored series names the rule reads."""
        raise NotImplementedError

    def absorb(self, records: Records) -> list[tuple[int, RowT]]:
        """Takes in a feed's records (baselines' heads, flags); returns the rows judged once baselines exist."""
        raise NotImplementedError

    def ready_to_judge(self) -> bool:
        """Settles what the baselines fix, once they exist (raises Rewind if a late series changes it)."""
        raise NotImplementedError

    def judge(self, row: RowT) -> tuple[bool, bool]:
        """(the condition holds, it held long enough to fire) at one row, updating the streaks."""
        raise NotImplementedError

    def figures(self, span: Span, row: RowT) -> Figures:
        raise NotImplementedError

    def feed(self, records: Records) -> tuple[list[Episode], list[Episode]]:
        """Advances over a feed: (episodes resolved in it, pending episodes dropped in it)."""
        m = self.m
        m.pending += [(step, asdict(row)) for step, row in self.absorb(records)]
        resolved: list[Episode] = []
        dropped: list[Episode] = []
        if not self.ready_to_judge() or not m.pending:
            return resolved, dropped
        rows, m.pending = m.pending, []
        for step, values in rows:
            row = self.Row(**values)
            hold, ready = self.judge(row)
            span, gone = m.advance(step, hold, ready, values, self.config.resolve_window)
            if gone is not None:
                dropped.append(self.episode(gone[0], self.Row(**gone[1])))
            if span is not None:
                resolved.append(self.episode(span, row))
        m.tail = _episode_state(resolved[-1]) if resolved and resolved[-1].last_step == m.latest else None
        return resolved, dropped

    def episode(self, span: Span, row: RowT) -> Episode:
        return Episode(
            rule=self.name,
            severity=self.severity,
            sampler=self.sampler,
            state=span.state,
            onset_step=span.onset,
            fired_step=span.fired,
            resolved_step=span.resolved,
            last_step=span.last,
            **asdict(self.figures(span, row)),  # an episode's last fields are its figures, named alike
        )

    def open_episode(self) -> Episode | None:
        span = self.m.open_span()
        if span is None or self.m.latest_row is None:
            return None
        return self.episode(span, self.Row(**self.m.latest_row))

    def streak(self, index: int, hold: bool) -> int:
        self.m.streaks[index] = self.m.streaks[index] + 1 if hold else 0
        return self.m.streaks[index]

    def state(self) -> dict[str, Any]:
        return {"machine": asdict(self.m), "rule": asdict(self.s)}

    def _restore(self, saved: dict[str, Any] | None) -> tuple[Machine, StateT]:
        if saved is None:
            return Machine(), self.State()
        try:
            machine = Machine(**saved["machine"])
            own = self.State(**saved["rule"])
            machine.pending = [(int(step), dict(row)) for step, row in machine.pending]  # JSON made them lists
            for row in (machine.latest_row, machine.held):
                if row is not None:
                    self.Row(**row)  # its fields must fit
            for _, row in machine.pending:
                self.Row(**row)
        except (KeyError, TypeError, ValueError) as e:  # a state saved by rules of another shape
            raise Rewind from e
        return machine, own


def _episode_state(episode: Episode) -> dict[str, Any]:
    return {f.name: getattr(episode, f.name) for f in fields(Episode)}


def level(threshold: float, baseline: float, drop_fraction: float) -> float:
    """Below this a signal counts as low: the absolute threshold, or the relative drop when higher."""
    # A relative drop means nothing from a baseline at or below zero.
    return max(threshold, (1 - drop_fraction) * baseline) if baseline > 0 else threshold


def recovering(span: Span, config: AlertSettings) -> str:
    """For a firing alert whose condition missed some steps: how many held, and what resolves it."""
    if span.n_held == span.n_rows or span.resolved is not None:
        return ""
    return f" (held at {span.n_held} of them; resolves after {config.resolve_window} scored steps in a row without it)"
