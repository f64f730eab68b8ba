"""Template-collapse alert rules, evaluated on a run's stored series after each scored step.

Pure: series in, alert episodes out. The rules replay the stored history of a (run, sampler)
through their state machine (``machine``), so the result never depends on what a previous process
remembered; a ``Replay`` resumes from the state it saved after an earlier step (stored with the
alerts, ``service.alerts.state``) and then reads only the newer points, so a step costs the same
after 10 or 10,000 steps and comes out as the whole replay would.

``RULES`` is the one registry: a row per rule, saying where it runs. A rule is its class (its
typed ``Row``, its own ``State``, the series it ``needs``, how it judges and what it says):

    TemplateCollapse  (per scored sampler) input dependence falls while H(Z|X) does not (``template``)
    EntropyCollapse   (per scored sampler) H(Z|X) falls below a share of its baseline (``entropy``)
    LowRewardSignal   (batch figures)      rewards stop varying within prompt groups (``reward``)
    NoReasoning       (batch figures)      no turn carries reasoning to score (``reasoning``)

The signals TemplateCollapse can watch are the rows of ``service.schemas.alerts.SIGNALS``.
A baseline is the median of the first ``baseline_steps`` values; rules wait for it.
Must not import fastapi or touch the database.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from service.alerts.rules.entropy import EntropyCollapse
from service.alerts.rules.machine import Episode, Records, Rewind, Rule, Series
from service.alerts.rules.reasoning import NoReasoning
from service.alerts.rules.reward import LowRewardSignal
from service.alerts.rules.template import TemplateCollapse, lost_prompts
from service.schemas.alerts import AlertSettings, RuleName
from service.storage.labels import BATCH

__all__ = ["RULES", "RULES_VERSION", "Episode", "Replay", "Rewind", "Series", "evaluate", "needed_series"]


@dataclass(frozen=True)
class RuleEntry:
    """One rule of the registry: its class and which series it runs on."""

    kind: type[Rule[Any, Any]]
    scope: Literal["sampler", "batch"]  # each scored sampler's series, or the batch figures (sampler "all")

    @property
    def name(self) -> RuleName:
        return self.kind.name


RULES = (
    RuleEntry(TemplateCollapse, "sampler"),
    RuleEntry(EntropyCollapse, "sampler"),
    RuleEntry(LowRewardSignal, "batch"),
    RuleEntry(NoReasoning, "batch"),
)
# In a checkpoint's key (``service.alerts.state.rules_key``): a state saved by other rules is not resumed.
# Bump it when a rule judges differently; a saved state lacking a rule, or whose shape changed, is replayed
# from the start anyway (``Rewind``).
RULES_VERSION = 5


class Replay:
    """The rules of one (run, sampler) over its history, resumable from a stored state.

    A fresh replay fed the whole history gives every episode (``evaluate``). A replay resumed from
    the state saved after step S and fed only the points after S (all at later steps) reaches the
    same state and episodes as the whole history would: the rules' baselines are fixed by the
    first ``baseline_steps`` values, the CUSUM and the state machine carry their state forward, and
    an episode's figures come from its own last row. The exceptions raise ``Rewind``: a series that
    decides how every step is judged appeared only now (see ``TemplateCollapse``), or the saved state
    lacks one of the rules or has another shape; the caller then replays the whole history.
    """

    def __init__(self, run: str, sampler: str, config: AlertSettings, state: dict[str, Any] | None = None) -> None:
        scope = "batch" if sampler == BATCH else "sampler"
        entries = [entry for entry in RULES if entry.scope == scope]
        if state is not None and any(entry.name not in state for entry in entries):
            raise Rewind  # a rule added since the state was saved must take its baseline from the first steps
        self.rules = [
            entry.kind(run, sampler, config, None if state is None else state[entry.name]) for entry in entries
        ]
        self.resolved: list[Episode] = []
        self.dropped: list[Episode] = []  # pending episodes whose condition broke before they fired
        self.tails = [rule.m.tail for rule in self.rules]

    def feed(self, series: Series) -> None:
        """Advances every rule over ``series`` (points at steps after the saved state's, ascending)."""
        records = _records(series)
        for rule in self.rules:
            resolved, dropped = rule.feed(records)
            self.resolved += resolved
            self.dropped += dropped

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
            if isinstance(rule, TemplateCollapse) and lost is not None:
                said = lost_prompts(list(lost))
                mine = [replace(e, summary=e.summary + said) if e.last_step == rule.m.latest else e for e in mine]
            out += mine
        return out

    def state(self) -> dict[str, Any]:
        return {rule.name: rule.state() for rule in self.rules}


def _records(series: Series) -> Records:
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
    """The stored names the rules read, each once."""
    return tuple(dict.fromkeys(name for entry in RULES for name in entry.kind.needs(config)))


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
