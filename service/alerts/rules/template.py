"""TemplateCollapse: input dependence falls while within-input entropy does not (RAGEN-2's template collapse).

The rule watches one signal (``AlertSettings.signal``, a row of ``SIGNALS``): a level below which
it counts as low (the absolute threshold, or a drop of more than ``drop_fraction`` from the run's
baseline, whichever is higher), or, for ``mi_cusum``, a one-sided CUSUM of mi_estimate against its
baseline that rises above ``cusum_threshold``. A step counts only while H(Z|X) stays within its band
(no more than ``entropy_band`` below its baseline, ``entropy_band_above`` above): the failure entropy
cannot see. The band judges until an episode fires; a firing episode resolves only once the signal is
back above its release level (halfway from the level to the baseline by default), so neither a partial
recovery while the cause stands nor H(Z|X) leaving its band (a blow-up on top of the collapse) ends it;
steps of fewer than ``min_prompts`` distinct prompts are not judged. When the episode reaches the latest
batch it names that batch's prompts that lost input dependence. Must not import fastapi or touch the
database.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scoring.estimators import between_step_variance, cusum
from service.alerts.rules.machine import Figures, Records, Rewind, Rule, Span, level, recovering
from service.schemas.alerts import CUSUM, SIGNALS, AlertSettings

CUSUM_SE_FLOOR = 0.05  # share of the MI baseline: a standard error is never taken as smaller
MI, SE, CI = "mi_estimate", "mi_estimate_se", "mi_estimate_ci_high"
PROMPTS = "distinct_prompts"  # P, the distinct prompts of a step's scored rows (a step without it is judged)

TEMPLATE_ADVICE = (
    "Reasoning no longer depends on the input although its entropy looks healthy (RAGEN-2 template "
    "collapse). Check which prompts lost input dependence in the per-prompt breakdown of the latest batch "
    "(GET /v1/batches/{id}); enable SNR-aware filtering. The paper ran RAGEN's filter in softmax mode, top_p "
    "0.9, which keeps about 90% of the groups or more (all 8 a step in docs/evaluation.md's remedy trial); "
    "linear mode at 0.9 (SNRFilter's default, variant ragen) kept ~40% there. If it is on, lower its value. "
    "Lower the KL or entropy-regularization weight."
)


@dataclass(frozen=True)
class TemplateRow:
    """One step: the signal (for mi_cusum its statistic), H(Z|X), the MI interval's top and MI itself."""

    signal: float
    entropy: float
    ci_high: float | None
    mi: float | None


@dataclass
class TemplateState:
    """What TemplateCollapse keeps beyond the state machine."""

    has_intervals: bool = False  # a mi_estimate_ci_high point was seen
    confirm: bool | None = None  # whether rows were judged against the intervals (None: none judged yet)
    cusum: list[float] | None = None  # mi_cusum: [baseline, tau^2, S] once the statistic runs
    cusum_dead: bool = False  # mi_cusum: the MI baseline is not positive, nothing to fall from
    # mi_cusum: steps waiting for the statistic to run, as [step, se, entropy, ci_high, mi]
    cusum_rows: list[list[float | None]] = field(default_factory=list)


class TemplateCollapse(Rule[TemplateRow, TemplateState]):
    name = "TemplateCollapse"
    severity = "critical"
    advice = TEMPLATE_ADVICE
    Row = TemplateRow
    State = TemplateState
    fixed: tuple[float, float, float | None, float, float]  # signal, entropy, MI baselines; level, MI level

    @staticmethod
    def needs(config: AlertSettings) -> tuple[str, ...]:
        signal = (config.signal,) if config.signal != CUSUM else ()
        return (*signal, MI, SE, CI, SIGNALS[config.signal].entropy, PROMPTS)

    def absorb(self, records: Records) -> list[tuple[int, TemplateRow]]:
        m, s, config, cumulative = self.m, self.s, self.config, self.config.signal == CUSUM
        entropy_name = SIGNALS[config.signal].entropy
        names = {MI, entropy_name} | (set() if cumulative else {config.signal})
        rows: list[tuple[int, TemplateRow]] = []
        for step, values in records:
            if values.get(PROMPTS, math.inf) < config.min_prompts:
                continue  # too few prompts to see: not judged, not in the baselines (AlertSettings.min_prompts)
            for name in names & values.keys():
                m.head(name, values[name], config)
            s.has_intervals = s.has_intervals or CI in values
            if not cumulative:
                signal, entropy = values.get(config.signal), values.get(entropy_name)
                if signal is not None and entropy is not None:
                    rows.append((step, TemplateRow(signal, entropy, values.get(CI), values.get(MI))))
            elif MI in values and SE in values and not s.cusum_dead:
                s.cusum_rows.append([step, values[SE], values.get(entropy_name), values.get(CI), values[MI]])
        return rows + self._cusum_rows() if cumulative else rows

    def _cusum_rows(self) -> list[tuple[int, TemplateRow]]:
        """The waiting (mi_estimate, se) steps as CUSUM rows, once the statistic can run: it needs the
        MI baseline and the between-step variance of the first ``baseline_steps`` steps."""
        m, s, config = self.m, self.s, self.config
        if s.cusum is None:
            base = m.baseline(MI, config)
            if base is not None and base <= 0:
                s.cusum_dead, s.cusum_rows = True, []
            if base is None or base <= 0 or len(s.cusum_rows) < config.baseline_steps:
                return []
            head = [(float(r[4]), float(r[1])) for r in s.cusum_rows[: config.baseline_steps]]  # type: ignore[arg-type]  # mi and se are present on these steps
            s.cusum = [base, between_step_variance([v for v, _ in head], [e for _, e in head]), 0.0]
        base, tau2, statistic = s.cusum
        rows: list[tuple[int, TemplateRow]] = []
        for step, se, entropy, ci, mi in s.cusum_rows:
            assert step is not None
            assert se is not None
            assert mi is not None
            (statistic,) = cusum(
                [mi],
                [se],
                baseline=base,
                drop=config.cusum_drop * base,
                se_floor=CUSUM_SE_FLOOR * base,
                tau2=tau2,
                start=statistic,
            )
            m.head(CUSUM, statistic, config)
            if entropy is not None:
                rows.append((int(step), TemplateRow(statistic, entropy, ci, mi)))
        s.cusum[2], s.cusum_rows = statistic, []
        return rows

    def ready_to_judge(self) -> bool:
        m, config = self.m, self.config
        cumulative = config.signal == CUSUM
        signal_base = m.baseline(config.signal, config)
        entropy_base = m.baseline(SIGNALS[config.signal].entropy, config)
        if signal_base is None or entropy_base is None:
            return False
        mi_base = m.baseline(MI, config)
        # Noise guard: a step also needs the whole bootstrap interval of the MI estimate below the same
        # relative level of its own baseline, so one batch's sampling noise cannot count as a drop.
        confirm = config.use_intervals and self.s.has_intervals and mi_base is not None and not cumulative
        if self.s.confirm is not None and self.s.confirm != confirm:
            raise Rewind  # the intervals (or the MI baseline) appeared after steps were judged without them
        self.s.confirm = confirm
        # The CUSUM already weighs each step by its standard error: it rises above a fixed level.
        threshold = (
            config.cusum_threshold if cumulative else level(config.signal_threshold, signal_base, config.drop_fraction)
        )
        mi_level = level(SIGNALS[MI].threshold, mi_base or 0.0, config.drop_fraction)
        self.fixed = (signal_base, entropy_base, mi_base, threshold, mi_level)
        return True

    def judge(self, row: TemplateRow) -> tuple[bool, bool]:
        config, (signal_base, entropy_base, _, threshold, mi_level) = self.config, self.fixed
        firing = self.m.fired is not None
        if firing and config.signal != CUSUM:
            # Hysteresis: a firing episode's cause stands until the signal is well back, not just over the level.
            threshold = release_level(threshold, signal_base, config.release_fraction)
        # The band tells a template from an entropy collapse when an episode opens; once it fires, H(Z|X)
        # leaving the band (rising with a blow-up, sinking as the policy sharpens) is no sign the cause is gone.
        in_band = (firing and not config.entropy_band_while_firing) or in_band_of(row.entropy, entropy_base, config)
        hold = (
            (row.signal > threshold if config.signal == CUSUM else row.signal < threshold)
            and in_band
            and (not self.s.confirm or (row.ci_high if row.ci_high is not None else math.inf) < mi_level)
        )
        return hold, self.streak(0, hold) >= config.window

    def figures(self, span: Span, row: TemplateRow) -> Figures:
        config, (signal_base, entropy_base, mi_base, threshold, mi_level) = self.config, self.fixed
        value = row.signal
        if config.signal == CUSUM:
            mi = row.mi if row.mi is not None else float("nan")
            change = (
                f"mi_estimate {mi:.4g} fell from its baseline {mi_base or 0.0:.4g} "
                f"(its CUSUM {value:.4g} rose above {threshold:.4g} standard errors)"
            )
        else:
            bound = (
                f" (the 95% interval of mi_estimate reaches {row.ci_high:.4g}, under {mi_level:.4g})"
                if self.s.confirm and row.ci_high is not None
                else ""
            )
            change = f"{config.signal} {value:.4g} fell below {threshold:.4g} (baseline {signal_base:.4g}){bound}"
            if span.fired is not None and value >= threshold:  # a firing alert's good step: say so
                release = release_level(threshold, signal_base, config.release_fraction)
                change = (
                    f"{config.signal} {value:.4g} is back above {threshold:.4g} (baseline {signal_base:.4g}; it "
                    f"resolves above {release:.4g})"
                )
        entropy = "did not fall"
        if not in_band_of(row.entropy, entropy_base, config):
            held_on = span.fired is not None and not config.entropy_band_while_firing
            entropy = (
                "has left its band since the episode fired (the signal alone resolves it)"
                if held_on
                else "left its band"
            )
        summary = (
            f"{self.name} on run {self.run} ({self.sampler}) at step {span.last}: {change} over {span.n_rows} scored "
            f"steps since step {span.onset}{recovering(span, config)}, while H(Z|X) {row.entropy:.4g} {entropy} "
            f"(baseline {entropy_base:.4g})"
        )
        return Figures(value, signal_base, threshold, summary, self.advice)


def in_band_of(entropy: float, baseline: float, config: AlertSettings) -> bool:
    """H(Z|X) within its band: no more than ``entropy_band`` below its baseline, ``entropy_band_above`` above."""
    return (1 - config.entropy_band) * baseline <= entropy <= (1 + config.entropy_band_above) * baseline


def release_level(threshold: float, baseline: float, fraction: float) -> float:
    """Above this a firing episode's step counts as recovered: ``fraction`` of the way from the level back to
    the baseline (the level itself when the baseline is not above it)."""
    return threshold + fraction * (baseline - threshold) if baseline > threshold else threshold


def lost_prompts(lost: list[int] | None) -> str:
    """Names the latest batch's prompts that lost input dependence (said by the episode reaching that batch)."""
    if lost is None:
        return ""
    if not lost:
        return "; no single prompt of the latest batch stands out as lost"
    return f"; prompts (group ids) of the latest batch that lost input dependence: {', '.join(map(str, lost))}"
