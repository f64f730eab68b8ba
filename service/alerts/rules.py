"""Template-collapse alert rules, evaluated on a run's stored series after each scored step.

Pure: series in, alert episodes out. The rules replay the stored history of a (run, sampler)
through their state machine, so the result never depends on what a previous process remembered;
a ``Replay`` resumes from the state it saved after an earlier step (stored with the alerts,
``service.alerts.state``) and then reads only the newer points, so a step costs the same after
10 or 10,000 steps and comes out as the whole replay would:

    condition holds ──▶ pending ──(holds `window` consecutive steps)──▶ firing
    pending ──(condition fails)──▶ dropped (never fired, nothing to tell)
    firing ──(condition fails `resolve_window` consecutive steps)──▶ resolved

Rules (RAGEN-2: entropy stays flat while input dependence vanishes under template collapse):
    TemplateCollapse  the input-dependence signal falls below a threshold, or drops by more than
                      ``drop_fraction`` from the run's baseline (for ``mi_cusum``, the default: its
                      CUSUM rises above ``cusum_threshold``), while H(Z|X) stays within its band
                      (no more than ``entropy_band`` below its baseline, ``entropy_band_above``
                      above): the failure entropy cannot see. When the episode reaches the latest
                      batch it names that batch's prompts that lost input dependence.
    EntropyCollapse   H(Z|X) (or the matched-pair token entropy) falls below ``entropy_floor`` of
                      its baseline: reasoning became deterministic per input.
    LowRewardSignal   the mean in-group reward std stays below ``reward_std_fraction`` of its
                      baseline for ``reward_window`` steps (RAGEN's early-stop rule), or the share
                      of zero-variance groups exceeds ``zero_variance_ratio`` for ``window`` steps.
    NoReasoning       no turn of the run's batches carried reasoning to score for ``window``
                      batches in a row: no collapse metric can be computed (no baseline needed).
A baseline is the median of the first ``baseline_steps`` values; rules wait for it.
Must not import fastapi or touch the database.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from scoring.estimators import between_step_variance, cusum
from service.schemas.alerts import SIGNAL_THRESHOLDS, AlertSettings, AlertState, RuleName, Severity

Series = dict[str, list[tuple[int, float]]]  # stored name -> [(step, value)], ascending steps
CUSUM = "mi_cusum"  # not a stored series: computed here from mi_estimate and mi_estimate_se
CUSUM_SE_FLOOR = 0.05  # share of the MI baseline: a standard error is never taken as smaller
TEMPLATE: RuleName = "TemplateCollapse"
ENTROPY: RuleName = "EntropyCollapse"
REWARD: RuleName = "LowRewardSignal"
NO_REASONING: RuleName = "NoReasoning"
SEVERITY: dict[RuleName, Severity] = {
    TEMPLATE: "critical",
    ENTROPY: "warning",
    REWARD: "warning",
    NO_REASONING: "warning",
}


@dataclass(frozen=True)
class Episode:
    """One alert of one rule: when it began, fired and resolved, and the figures behind it."""

    rule: RuleName
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

    @property
    def severity(self) -> Severity:
        return SEVERITY[self.rule]


@dataclass(frozen=True)
class _Span:
    """Where one episode lies on the step axis, as the state machine found it, and the rows it spans."""

    onset: int
    fired: int | None
    resolved: int | None
    last: int
    n_rows: int  # the rule's rows from the onset to the last step, both included
    n_held: int  # ... of which the condition held

    @property
    def state(self) -> AlertState:
        return "resolved" if self.resolved is not None else "firing" if self.fired is not None else "pending"


@dataclass(frozen=True)
class _Figures:
    """What an episode reports at its last step."""

    value: float
    baseline: float
    threshold: float
    summary: str
    description: str


class Rewind(Exception):
    """New points change how earlier steps are judged (a series the rules confirm with appeared late):
    the history must be replayed from its start."""


Inputs = list[float | None]  # what a rule's figures need at one of its rows


@dataclass
class _Machine:
    """One rule's resumable state: the state machine's open episode, its streaks, the newest row.

    The state machine over a rule's rows (one per step, ascending):

        firing: a row the condition misses counts towards ``resolve_window``; enough in a row resolve it
        otherwise: a row the condition holds opens (or continues) a pending episode, which fires on a
        row where it held long enough (``ready``); a row it misses drops a pending episode

    ``pending`` holds rows that arrived before the rule's baselines existed (fewer than
    ``baseline_steps`` of them, so at most that many): once they exist they are judged in order.
    Plain values only: the state is stored as JSON.
    """

    onset: int | None = None
    fired: int | None = None
    clear: int = 0
    n_rows: int = 0
    n_held: int = 0
    streaks: list[int] = field(default_factory=lambda: [0, 0])
    latest: int | None = None  # step of the rule's newest row
    latest_inputs: Inputs = field(default_factory=list)
    tail: dict[str, Any] | None = None  # the episode resolved at the newest row (re-described while it is)
    heads: dict[str, list[float]] = field(default_factory=dict)  # first baseline_steps values per series
    pending: list[tuple[int, Inputs]] = field(default_factory=list)
    # TemplateCollapse only:
    has_intervals: bool = False  # a mi_estimate_ci_high point was seen
    confirm: bool | None = None  # whether rows were judged against the intervals (None: none judged yet)
    cusum: list[float] | None = None  # mi_cusum: [baseline, tau^2, S] once the statistic runs
    cusum_dead: bool = False  # mi_cusum: the MI baseline is not positive, nothing to fall from
    cusum_rows: list[list[float | None]] = field(default_factory=list)  # steps waiting for the CUSUM to run

    def head(self, name: str, value: float, config: AlertSettings) -> None:
        values = self.heads.setdefault(name, [])
        if len(values) < config.baseline_steps:
            values.append(value)

    def baseline(self, name: str, config: AlertSettings) -> float | None:
        values = self.heads.get(name, [])
        return statistics.median(values) if len(values) >= config.baseline_steps else None

    def advance(
        self, step: int, hold: bool, ready: bool, inputs: Inputs, resolve_window: int
    ) -> tuple[_Span | None, int | None]:
        """One row through the state machine: (the episode it resolved, the onset of the pending one it dropped)."""
        self.latest, self.latest_inputs = step, inputs
        if self.onset is not None and self.fired is not None:
            self.n_rows, self.n_held = self.n_rows + 1, self.n_held + hold
            self.clear = 0 if hold else self.clear + 1
            if self.clear < resolve_window:
                return None, None
            span = _Span(self.onset, self.fired, step, step, self.n_rows, self.n_held)
            self.onset, self.fired, self.clear = None, None, 0
            return span, None
        if hold:
            if self.onset is None:
                self.onset, self.n_rows, self.n_held = step, 0, 0
            self.n_rows, self.n_held = self.n_rows + 1, self.n_held + 1
            if ready:
                self.fired = step
            return None, None
        dropped, self.onset = self.onset, None
        return None, dropped

    def open_span(self) -> _Span | None:
        if self.onset is None or self.latest is None:
            return None
        return _Span(self.onset, self.fired, None, self.latest, self.n_rows, self.n_held)


class _Rule:
    """A rule over the per-step records of one (run, sampler): which rows it reads, judges and describes."""

    name: RuleName

    def __init__(self, run: str, sampler: str, config: AlertSettings, machine: _Machine) -> None:
        self.run, self.sampler, self.config, self.m = run, sampler, config, machine

    def absorb(self, records: list[tuple[int, dict[str, float]]]) -> list[tuple[int, Inputs]]:
        """Takes in a feed's records (baselines' heads, flags); returns the rows judged once baselines exist."""
        raise NotImplementedError

    def ready_to_judge(self) -> bool:
        """Settles what the baselines fix, once they exist (raises Rewind if a late series changes it)."""
        raise NotImplementedError

    def judge(self, inputs: Inputs) -> tuple[bool, bool]:
        """(the condition holds, it held long enough to fire) at one row, updating the streaks."""
        raise NotImplementedError

    def figures(self, span: _Span, inputs: Inputs) -> _Figures:
        raise NotImplementedError

    def feed(self, records: list[tuple[int, dict[str, float]]]) -> tuple[list[Episode], list[int]]:
        """Advances over a feed: (episodes resolved in it, onsets of pending episodes dropped)."""
        m = self.m
        m.pending += self.absorb(records)
        resolved: list[Episode] = []
        dropped: list[int] = []
        if not self.ready_to_judge() or not m.pending:
            return resolved, dropped
        rows, m.pending = m.pending, []
        for step, inputs in rows:
            hold, ready = self.judge(inputs)
            span, gone = m.advance(step, hold, ready, inputs, self.config.resolve_window)
            if gone is not None:
                dropped.append(gone)
            if span is not None:
                resolved.append(self.episode(span, inputs))
        m.tail = _episode_state(resolved[-1]) if resolved and resolved[-1].last_step == m.latest else None
        return resolved, dropped

    def episode(self, span: _Span, inputs: Inputs) -> Episode:
        return Episode(
            rule=self.name,
            sampler=self.sampler,
            state=span.state,
            onset_step=span.onset,
            fired_step=span.fired,
            resolved_step=span.resolved,
            last_step=span.last,
            **asdict(self.figures(span, inputs)),  # an episode's last fields are its figures, named alike
        )

    def open_episode(self) -> Episode | None:
        span = self.m.open_span()
        return self.episode(span, self.m.latest_inputs) if span is not None else None

    def streak(self, index: int, hold: bool) -> int:
        self.m.streaks[index] = self.m.streaks[index] + 1 if hold else 0
        return self.m.streaks[index]


def _episode_state(episode: Episode) -> dict[str, Any]:
    return {name: getattr(episode, name) for name in Episode.__dataclass_fields__}


def _level(threshold: float, baseline: float, drop_fraction: float) -> float:
    """Below this a signal counts as low: the absolute threshold, or the relative drop when higher."""
    # A relative drop means nothing from a baseline at or below zero.
    return max(threshold, (1 - drop_fraction) * baseline) if baseline > 0 else threshold


TEMPLATE_ADVICE = (
    "Reasoning no longer depends on the input although its entropy looks healthy (RAGEN-2 template "
    "collapse). Check which prompts lost input dependence in the per-prompt breakdown of the latest batch "
    "(GET /v1/batches/{id}); enable SNR-aware filtering (RAGEN's rollout filter, top_p 0.9) or lower its "
    "top_p; lower the KL or entropy-regularization weight."
)


class _Template(_Rule):
    """TemplateCollapse. Rows: steps with the signal (for mi_cusum: the CUSUM over the steps with
    mi_estimate and its standard error) and H(Z|X); inputs [signal, H(Z|X), ci_high, mi_estimate]."""

    name = TEMPLATE
    fixed: tuple[float, float, float | None, float, float]  # signal, entropy, MI baselines; level, MI level
    MI, SE, CI, ENTROPY = "mi_estimate", "mi_estimate_se", "mi_estimate_ci_high", "conditional_entropy_est"

    def absorb(self, records: list[tuple[int, dict[str, float]]]) -> list[tuple[int, Inputs]]:
        m, config, cumulative = self.m, self.config, self.config.signal == CUSUM
        names = {self.MI, self.ENTROPY} | (set() if cumulative else {config.signal})
        rows: list[tuple[int, Inputs]] = []
        for step, values in records:
            for name in names & values.keys():
                m.head(name, values[name], config)
            m.has_intervals = m.has_intervals or self.CI in values
            inputs: Inputs = [
                values.get(config.signal),
                values.get(self.ENTROPY),
                values.get(self.CI),
                values.get(self.MI),
            ]
            if not cumulative:
                if inputs[0] is not None and inputs[1] is not None:
                    rows.append((step, inputs))
            elif self.MI in values and self.SE in values and not m.cusum_dead:
                m.cusum_rows.append([step, values[self.SE], *inputs[1:]])
        return rows + self._cusum_rows() if cumulative else rows

    def _cusum_rows(self) -> list[tuple[int, Inputs]]:
        """The waiting (mi_estimate, se) steps as CUSUM rows, once the statistic can run: it needs the
        MI baseline and the between-step variance of the first ``baseline_steps`` steps."""
        m, config = self.m, self.config
        if m.cusum is None:
            base = m.baseline(self.MI, config)
            if base is not None and base <= 0:
                m.cusum_dead, m.cusum_rows = True, []
            if base is None or base <= 0 or len(m.cusum_rows) < config.baseline_steps:
                return []
            head = [(r[4], r[1]) for r in m.cusum_rows[: config.baseline_steps]]
            m.cusum = [base, between_step_variance([v for v, _ in head], [e for _, e in head]), 0.0]  # type: ignore[misc]  # mi and se are present on these steps
        base, tau2, s = m.cusum
        rows: list[tuple[int, Inputs]] = []
        for step, se, entropy, ci, mi in m.cusum_rows:
            assert step is not None
            assert se is not None
            assert mi is not None
            (s,) = cusum(
                [mi],
                [se],
                baseline=base,
                drop=config.cusum_drop * base,
                se_floor=CUSUM_SE_FLOOR * base,
                tau2=tau2,
                start=s,
            )
            m.head(CUSUM, s, config)
            if entropy is not None:
                rows.append((int(step), [s, entropy, ci, mi]))
        m.cusum[2], m.cusum_rows = s, []
        return rows

    def ready_to_judge(self) -> bool:
        m, config = self.m, self.config
        cumulative = config.signal == CUSUM
        signal_base, entropy_base = m.baseline(config.signal, config), m.baseline(self.ENTROPY, config)
        if signal_base is None or entropy_base is None:
            return False
        mi_base = m.baseline(self.MI, config)
        # Noise guard: a step also needs the whole bootstrap interval of the MI estimate below the same
        # relative level of its own baseline, so one batch's sampling noise cannot count as a drop.
        confirm = config.use_intervals and m.has_intervals and mi_base is not None and not cumulative
        if m.confirm is not None and m.confirm != confirm:
            raise Rewind  # the intervals (or the MI baseline) appeared after steps were judged without them
        m.confirm = confirm
        # The CUSUM already weighs each step by its standard error: it rises above a fixed level.
        level = (
            config.cusum_threshold if cumulative else _level(config.signal_threshold, signal_base, config.drop_fraction)
        )
        mi_level = _level(SIGNAL_THRESHOLDS["mi_estimate"], mi_base or 0.0, config.drop_fraction)
        self.fixed = (signal_base, entropy_base, mi_base, level, mi_level)
        return True

    def judge(self, inputs: Inputs) -> tuple[bool, bool]:
        value, entropy, ci, _ = inputs
        assert value is not None
        assert entropy is not None
        config, (_, entropy_base, _, level, mi_level) = self.config, self.fixed
        hold = (
            (value > level if config.signal == CUSUM else value < level)
            and (1 - config.entropy_band) * entropy_base <= entropy <= (1 + config.entropy_band_above) * entropy_base
            and (not self.m.confirm or (ci if ci is not None else math.inf) < mi_level)
        )
        return hold, self.streak(0, hold) >= config.window

    def figures(self, span: _Span, inputs: Inputs) -> _Figures:
        value, entropy, ci, mi = inputs
        assert value is not None
        assert entropy is not None
        config, (signal_base, entropy_base, mi_base, level, mi_level) = self.config, self.fixed
        if config.signal == CUSUM:
            change = (
                f"mi_estimate {mi if mi is not None else float('nan'):.4g} fell from its baseline {mi_base or 0.0:.4g} "
                f"(its CUSUM {value:.4g} rose above {level:.4g} standard errors)"
            )
        else:
            bound = (
                f" (the 95% interval of mi_estimate reaches {ci:.4g}, under {mi_level:.4g})"
                if self.m.confirm and ci is not None
                else ""
            )
            change = f"{config.signal} {value:.4g} fell below {level:.4g} (baseline {signal_base:.4g}){bound}"
            if value >= level:  # a firing alert's good step: say so, not "fell below"
                change = f"{config.signal} {value:.4g} is back above {level:.4g} (baseline {signal_base:.4g})"
        summary = (
            f"{TEMPLATE} on run {self.run} ({self.sampler}) at step {span.last}: {change} over {span.n_rows} scored "
            f"steps since step {span.onset}{_recovering(span, self.config)}, while H(Z|X) {entropy:.4g} did not "
            f"fall (baseline {entropy_base:.4g})"
        )
        return _Figures(value, signal_base, level, summary, TEMPLATE_ADVICE)


def _recovering(span: _Span, config: AlertSettings) -> str:
    """For a firing alert whose condition missed some steps: how many held, and what resolves it."""
    if span.n_held == span.n_rows or span.resolved is not None:
        return ""
    return f" (held at {span.n_held} of them; resolves after {config.resolve_window} scored steps in a row without it)"


def _lost_prompts(lost: Sequence[int] | None) -> str:
    """Names the latest batch's prompts that lost input dependence (said by the episode reaching that batch)."""
    if lost is None:
        return ""
    if not lost:
        return "; no single prompt of the latest batch stands out as lost"
    return f"; prompts (group ids) of the latest batch that lost input dependence: {', '.join(map(str, lost))}"


ENTROPY_ADVICE = (
    "Reasoning became (nearly) deterministic for each input. Raise the rollout temperature or the "
    "entropy bonus, or lower the learning rate; watch whether MI follows."
)


class _Entropy(_Rule):
    """EntropyCollapse. Rows: the steps of the entropy signal; inputs [value]."""

    name = ENTROPY

    def absorb(self, records: list[tuple[int, dict[str, float]]]) -> list[tuple[int, Inputs]]:
        name, rows = self.config.entropy_signal, list[tuple[int, Inputs]]()
        for step, values in records:
            if name in values:
                self.m.head(name, values[name], self.config)
                rows.append((step, [values[name]]))
        return rows

    def ready_to_judge(self) -> bool:
        base = self.m.baseline(self.config.entropy_signal, self.config)
        if base is not None and base <= 0:
            self.m.pending = []  # no baseline to fall from: never judged, nothing kept
        return base is not None and base > 0

    def judge(self, inputs: Inputs) -> tuple[bool, bool]:
        (value,) = inputs
        assert value is not None
        hold = value < self._floor()
        return hold, self.streak(0, hold) >= self.config.window

    def _base(self) -> float:
        base = self.m.baseline(self.config.entropy_signal, self.config)
        assert base is not None  # judged only once it exists
        return base

    def _floor(self) -> float:
        return self.config.entropy_floor * self._base()

    def figures(self, span: _Span, inputs: Inputs) -> _Figures:
        (value,) = inputs
        assert value is not None
        change = "is back above" if value >= self._floor() else "fell below"
        summary = (
            f"{ENTROPY} on run {self.run} ({self.sampler}) at step {span.last}: {self.config.entropy_signal} "
            f"{value:.4g} {change} {self.config.entropy_floor:.0%} of its baseline {self._base():.4g} (since step "
            f"{span.onset}{_recovering(span, self.config)})"
        )
        return _Figures(value, self._base(), self._floor(), summary, ENTROPY_ADVICE)


REWARD_ADVICE = (
    "Rewards barely vary within prompt groups, so policy-gradient updates carry little signal relative to "
    "noise: the low-SNR regime that drives template collapse. Enable SNR-aware filtering (RAGEN's rollout "
    "filter: strategy top_p, linear, value 0.9) to train on the groups with the most reward spread; if it "
    "is on, lower its value (e.g. 0.7)."
)


class _Reward(_Rule):
    """LowRewardSignal. Rows: steps with the in-group reward std and the zero-variance share; inputs
    [std, zero share, filter kept ratio]."""

    name = REWARD
    STD, ZERO, KEPT = "rollout/in_group_reward_std", "zero_variance_group_ratio", "rollout/filter_kept_ratio"

    def absorb(self, records: list[tuple[int, dict[str, float]]]) -> list[tuple[int, Inputs]]:
        rows: list[tuple[int, Inputs]] = []
        for step, values in records:
            if self.STD in values:
                self.m.head(self.STD, values[self.STD], self.config)
                if self.ZERO in values:
                    rows.append((step, [values[self.STD], values[self.ZERO], values.get(self.KEPT)]))
        return rows

    def ready_to_judge(self) -> bool:
        return self.m.baseline(self.STD, self.config) is not None

    def _threshold(self) -> float:
        base = self.m.baseline(self.STD, self.config)
        assert base is not None
        return self.config.reward_std_fraction * base

    def judge(self, inputs: Inputs) -> tuple[bool, bool]:
        std, zero, _ = inputs
        assert std is not None
        assert zero is not None
        low_std, many_zero = std < self._threshold(), zero > self.config.zero_variance_ratio
        ready = self.streak(0, low_std) >= self.config.reward_window
        ready = self.streak(1, many_zero) >= self.config.window or ready
        return low_std or many_zero, ready

    def figures(self, span: _Span, inputs: Inputs) -> _Figures:
        std, zero, kept = inputs
        assert std is not None
        assert zero is not None
        base = self.m.baseline(self.STD, self.config)
        assert base is not None
        summary = (
            f"{REWARD} on run {self.run} at step {span.last}: mean in-group reward std {std:.4g} "
            f"(baseline {base:.4g}), {zero:.0%} of prompt groups without reward variance (since step {span.onset})"
        )
        advice = (
            f" On step {span.last} a top_p 0.9 filter would keep {kept:.0%} of the groups." if kept is not None else ""
        )
        return _Figures(std, base, self._threshold(), summary, REWARD_ADVICE + advice)


NO_REASONING_ADVICE = (
    "The run's batches carry no reasoning under its reasoning_extraction, so no collapse metric can be computed. "
    "If the model writes no <think> tags, create the run with reasoning_extraction auto (the default) or "
    "whole_response; if its think blocks are cut by the length limit (truncated_think_ratio), raise the "
    "maximum completion length; or send each turn's reasoning explicitly (reasoning or reasoning_token_ids)."
)


class _NoReasoning(_Rule):
    """NoReasoning. Rows: the steps of valid_thinking_rate; inputs [rate, truncated think ratio]."""

    name = NO_REASONING
    RATE, TRUNCATED = "valid_thinking_rate", "truncated_think_ratio"

    def absorb(self, records: list[tuple[int, dict[str, float]]]) -> list[tuple[int, Inputs]]:
        return [(step, [v[self.RATE], v.get(self.TRUNCATED)]) for step, v in records if self.RATE in v]

    def ready_to_judge(self) -> bool:
        return True  # no baseline

    def judge(self, inputs: Inputs) -> tuple[bool, bool]:
        hold = inputs[0] == 0
        return hold, self.streak(0, hold) >= self.config.window

    def figures(self, span: _Span, inputs: Inputs) -> _Figures:
        truncated = inputs[1]
        cut = (
            f"; {truncated:.0%} of the last batch's turns opened a think block and never closed it" if truncated else ""
        )
        summary = (
            f"{NO_REASONING} on run {self.run} at step {span.last}: no turn carried reasoning to score in "
            f"{span.n_held} batches in a row (since step {span.onset}){cut}"
        )
        return _Figures(0.0, 0.0, 0.0, summary, NO_REASONING_ADVICE)


RULES_VERSION = 1  # in a checkpoint's key: one written by other rules is not resumed, the history is replayed


class Replay:
    """The rules of one (run, sampler) over its history, resumable from a stored state.

    A fresh replay fed the whole history gives every episode (``evaluate``). A replay resumed from
    the state saved after step S and fed only the points after S (all at later steps) reaches the
    same state and episodes as the whole history would: the rules' baselines are fixed by the
    first ``baseline_steps`` values, the CUSUM and the state machine carry their state forward, and
    an episode's figures come from its own last row. The one exception raises ``Rewind``: a series
    that decides how every step is judged appeared only now (see ``_Template``); the caller then
    replays the whole history.
    """

    def __init__(self, run: str, sampler: str, config: AlertSettings, state: dict[str, Any] | None = None) -> None:
        saved = state or {}
        kinds: tuple[type[_Rule], ...] = (_Reward, _NoReasoning) if sampler == "all" else (_Template, _Entropy)
        self.rules = [kind(run, sampler, config, _machine(saved.get(kind.name))) for kind in kinds]
        self.resolved: list[Episode] = []
        self.dropped: list[tuple[RuleName, int]] = []
        self.tails = [rule.m.tail for rule in self.rules]

    def feed(self, series: Series) -> None:
        """Advances every rule over ``series`` (points at steps after the saved state's, ascending)."""
        records = _records(series)
        for rule in self.rules:
            resolved, dropped = rule.feed(records)
            self.resolved += resolved
            self.dropped += [(rule.name, onset) for onset in dropped]

    def episodes(self, lost: Sequence[int] | None = None) -> list[Episode]:
        """The episodes this replay touched, oldest first per rule: the one that ended at a rule's newest
        row before the feed (its summary may change), those the feed resolved, the open one.

        ``lost``: the latest batch's prompts that lost input dependence, named by the TemplateCollapse
        episode that reaches the rule's newest row.
        """
        out = []
        for rule, tail_before in zip(self.rules, self.tails, strict=True):
            mine = [e for e in self.resolved if e.rule == rule.name]
            if tail_before is not None:  # resolved in an earlier feed: older than anything in this one
                mine.insert(0, Episode(**tail_before))
            if (current := rule.open_episode()) is not None:
                mine.append(current)
            if rule.name == TEMPLATE and lost is not None:
                mine = [
                    replace(e, summary=e.summary + _lost_prompts(lost)) if e.last_step == rule.m.latest else e
                    for e in mine
                ]
            out += mine
        return out

    def state(self) -> dict[str, Any]:
        return {rule.name: asdict(rule.m) for rule in self.rules}


def _machine(saved: dict[str, Any] | None) -> _Machine:
    if saved is None:
        return _Machine()
    machine = _Machine(**saved)
    machine.pending = [(int(step), list(inputs)) for step, inputs in machine.pending]  # JSON made them lists
    return machine


def _records(series: Series) -> list[tuple[int, dict[str, float]]]:
    """Per step (ascending), the value of each series there; a later point of a step replaces an earlier one."""
    by_step: dict[int, dict[str, float]] = {}
    for name, points in series.items():
        for step, value in points:
            by_step.setdefault(step, {})[name] = value
    return sorted(by_step.items())


def evaluate(
    run: str, sampler: str, series: Series, config: AlertSettings, lost: Sequence[int] | None = None
) -> list[Episode]:
    """Every alert episode the rules produce on this (run, sampler)'s history, oldest first per rule.

    ``lost``: group ids of the prompts that lost input dependence in the latest batch
    (``SamplerResult.lost_group_ids``); a TemplateCollapse episode reaching that batch names them.
    """
    if not config.enabled:
        return []
    replay = Replay(run, sampler, config)
    replay.feed(series)
    return replay.episodes(lost)


def needed_series(config: AlertSettings) -> tuple[str, ...]:
    """The stored names the rules read."""
    return (
        *((config.signal,) if config.signal != CUSUM else ()),
        "mi_estimate",
        "mi_estimate_se",
        "mi_estimate_ci_high",
        "conditional_entropy_est",
        config.entropy_signal,
        "rollout/in_group_reward_std",
        "zero_variance_group_ratio",
        "rollout/filter_kept_ratio",
        "valid_thinking_rate",
        "truncated_think_ratio",
    )


def settings_table() -> str:
    """The defaults table of docs/alerts.md, generated from ``AlertSettings`` (a test keeps them equal)."""
    lines = ["| setting | default | meaning |", "| --- | --- | --- |"]
    for name, setting in AlertSettings.model_fields.items():
        default = setting.default
        shown = (
            "per signal" if default is None else f"`{str(default).lower() if isinstance(default, bool) else default}`"
        )
        meaning = (setting.description or "").replace("|", "\\|")
        lines.append(f"| `{name}` | {shown} | {meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(settings_table())
