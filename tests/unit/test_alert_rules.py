"""Alert rules on hand-built series: when they fire, resolve, stay quiet, and what they say."""

from __future__ import annotations

import json
import random

import pytest

from service.alerts.rules import Episode, Replay, Rewind, evaluate
from service.schemas.alerts import AlertSettings
from tests.fixtures import model_figures, run_figures

# These series are mi_zscore_ema's, written for the settings before the corpus calibration (issue 12).
ZSCORE = AlertSettings(signal="mi_zscore_ema", drop_fraction=0.4, window=3, use_intervals=True)


def steps(values, start=1):
    return [(start + i, float(v)) for i, v in enumerate(values)]


def template_series(signal, entropy=None):
    n = len(signal)
    return {"mi_zscore_ema": steps(signal), "conditional_entropy_est": steps(entropy or [2.0] * n)}


def test_template_collapse_fires_after_the_window_and_names_run_step_values_and_onset():
    signal = [4.0, 4.2, 3.8, 4.1, 4.0, 3.9, 1.0, 0.9, 0.8, 0.7]  # baseline = median of the first 5 = 4.0
    (episode,) = evaluate("ppo-7", "first_turn", template_series(signal), ZSCORE)
    assert (episode.rule, episode.state, episode.severity) == ("TemplateCollapse", "firing", "critical")
    assert (episode.onset_step, episode.fired_step, episode.last_step) == (7, 9, 10)
    assert episode.baseline == 4.0
    assert episode.threshold == pytest.approx(2.4)  # 40% below the baseline beats the absolute 0.0
    assert episode.summary.startswith(
        "TemplateCollapse on run ppo-7 (first_turn) at step 10: mi_zscore_ema 0.7 fell below 2.4 (baseline 4) "
        "over 4 scored steps since step 7, while H(Z|X) 2 did not fall (baseline 2)"
    )
    assert "per-prompt breakdown" in episode.description


def test_one_noisy_step_neither_fires_nor_resolves():
    quiet = [4.0] * 5 + [1.0, 4.0, 1.0, 1.0, 4.0, 4.0]  # never 3 low steps in a row
    assert evaluate("r", "s", template_series(quiet), ZSCORE) == []
    firing = [4.0] * 5 + [1.0, 1.0, 1.0, 4.0, 1.0, 4.0, 4.0]
    (episode,) = evaluate("r", "s", template_series(firing), ZSCORE)
    assert (episode.fired_step, episode.resolved_step, episode.state) == (8, 12, "resolved")


def test_a_firing_alert_on_a_good_step_says_the_signal_is_back_not_that_it_fell():
    signal = [4.0] * 5 + [1.0, 1.0, 1.0, 4.0]  # fired at 8, step 9 above the level, not yet resolved
    (episode,) = evaluate("r", "s", template_series(signal), ZSCORE)
    assert (episode.state, episode.last_step) == ("firing", 9)
    assert (
        "mi_zscore_ema 4 is back above 2.4 (baseline 4; it resolves above 3.2) over 4 scored steps since step 6 "
        "(held at 3 of them;" in episode.summary
    )
    assert "fell below" not in episode.summary


def test_a_partial_recovery_while_the_cause_stands_does_not_resolve_a_firing_episode():
    # Fires below 2.4 (baseline 4, drop 0.4); releases only above 3.2, halfway back to the baseline.
    partial = [4.0] * 5 + [1.0, 1.0, 1.0, 2.8, 2.9, 3.0, 1.0]
    (episode,) = evaluate("r", "s", template_series(partial), ZSCORE)
    assert (episode.fired_step, episode.resolved_step, episode.state) == (8, None, "firing")
    recovered = [4.0] * 5 + [1.0, 1.0, 1.0, 3.5, 3.6]
    (episode,) = evaluate("r", "s", template_series(recovered), ZSCORE)
    assert (episode.resolved_step, episode.state) == (10, "resolved")
    # release_fraction 0 resolves at the level itself, as before hysteresis: the episode flickers.
    first, second = evaluate("r", "s", template_series(partial), ZSCORE.model_copy(update={"release_fraction": 0.0}))
    assert (first.resolved_step, first.state, second.onset_step, second.state) == (10, "resolved", 12, "pending")


def test_a_firing_episode_does_not_resolve_because_entropy_left_its_band_while_the_signal_stays_low():
    # rooms-starved-s0's shape (docs/evaluation.md): dependence falls, the episode fires at 8, then the policy
    # blows up and H(Z|X) rises past 3 times its baseline (the band's top) while the signal stays at the floor.
    signal = [4.0] * 5 + [1.0] * 7
    entropy = [2.0] * 7 + [3.0, 7.0, 8.0, 9.0, 9.5]
    (episode,) = evaluate("r", "s", template_series(signal, entropy), ZSCORE)
    assert (episode.fired_step, episode.resolved_step, episode.state) == (8, None, "firing")
    assert "H(Z|X) 9.5 has left its band since the episode fired (the signal alone resolves it)" in episode.summary
    # Sinking below the band once firing (the policy sharpening) does not end it either; EntropyCollapse says so.
    sinking = [2.0] * 8 + [1.2, 0.9, 0.8, 0.8]
    episodes = evaluate("r", "s", template_series(signal, sinking), ZSCORE)
    assert [(e.rule, e.state, e.fired_step) for e in episodes] == [
        ("TemplateCollapse", "firing", 8),
        ("EntropyCollapse", "firing", 12),
    ]
    # The band still opens the judgement: a drop that arrives with entropy out of band never becomes a template.
    assert evaluate("r", "s", template_series(signal, [2.0] * 5 + [9.0] * 7), ZSCORE) == []
    # The rule frozen on 2026-12-06 counted the blow-up's steps as misses: resolved at 10, signal at the floor.
    old = ZSCORE.model_copy(update={"entropy_band_while_firing": True})
    (episode,) = evaluate("r", "s", template_series(signal, entropy), old)
    assert (episode.fired_step, episode.resolved_step, episode.state) == (8, 10, "resolved")


def test_steps_of_fewer_prompts_than_min_prompts_are_not_judged_nor_in_the_baseline():
    signal = [4.0, 4.0, 0.5, 4.0, 4.0, 4.0, 0.5, 0.5, 0.5, 0.5, 0.5]
    prompts = [8.0, 8.0, 2.0, 8.0, 8.0, 8.0, 3.0, 3.0, 3.0, 8.0, 8.0]
    series = {**template_series(signal), "distinct_prompts": steps(prompts)}
    # Step 3 (2 prompts) stays out of the baseline and steps 7-9 (3 prompts) are not judged: the episode opens
    # at step 10, the first low step of 8 prompts. With min_prompts 2 the same series opens it at step 7, and
    # step 3's 0.5 enters the baseline (the median of 4.0, 4.0, 0.5 is still 4.0).
    (episode,) = evaluate("r", "s", series, ZSCORE.model_copy(update={"window": 2}))
    assert (episode.onset_step, episode.fired_step, episode.baseline) == (10, 11, 4.0)
    (episode,) = evaluate("r", "s", series, ZSCORE.model_copy(update={"window": 2, "min_prompts": 2}))
    assert episode.onset_step == 7


def test_a_condition_still_short_of_the_window_is_pending():
    (episode,) = evaluate("r", "s", template_series([4.0] * 5 + [1.0, 1.0]), ZSCORE)
    assert (episode.state, episode.onset_step, episode.fired_step) == ("pending", 6, None)


def test_nothing_is_judged_before_the_baseline_exists():
    assert evaluate("r", "s", template_series([4.0, 0.1, 0.1, 0.1]), ZSCORE) == []


def test_an_input_dependence_drop_with_collapsing_entropy_is_entropy_collapse_not_template():
    signal = [4.0] * 5 + [1.0] * 4
    entropy = [2.0] * 5 + [0.5] * 4
    episodes = evaluate("r", "s", template_series(signal, entropy), ZSCORE)
    assert [(e.rule, e.state, e.onset_step) for e in episodes] == [("EntropyCollapse", "firing", 6)]
    assert "fell below 50% of its baseline 2" in episodes[0].summary


def test_template_reasoning_with_rising_entropy_is_still_template_collapse():
    # Generic template text often scores a higher per-token entropy than grounded reasoning.
    series = template_series([4.0] * 5 + [1.0] * 3, [2.0] * 5 + [3.2, 3.4, 3.3])
    assert [e.rule for e in evaluate("r", "s", series, ZSCORE)] == ["TemplateCollapse"]
    runaway = template_series([4.0] * 5 + [1.0] * 3, [2.0] * 5 + [7.0] * 3)  # beyond +200%
    assert evaluate("r", "s", runaway, ZSCORE) == []


def test_the_absolute_threshold_catches_a_run_that_never_had_dependence():
    series = template_series([-0.1, 0.05, -0.2, 0.0, -0.05, -0.1, -0.2, -0.1])
    (episode,) = evaluate("r", "s", series, ZSCORE)
    assert episode.threshold == 0.0  # baseline <= 0: only the absolute level applies
    assert (episode.onset_step, episode.fired_step) == (5, 7)  # 0.05 and 0.0 at steps 2 and 4 are not below


@pytest.mark.parametrize("signal", ["mi_estimate", "mi_zscore_ema"])
def test_a_drop_within_the_bootstrap_noise_of_the_mi_estimate_does_not_count(signal):
    low = [0.8] * 5 + [0.1, 0.1, 0.1]  # baseline 0.8: the level is 60% of it, 0.48
    noisy = {
        "mi_estimate": steps(low),
        "mi_zscore_ema": steps([4.0] * 5 + [0.5] * 3),
        "mi_estimate_ci_high": steps([1.0] * 5 + [0.55, 0.5, 0.55]),  # the interval still reaches the level
        "conditional_entropy_est": steps([2.0] * 8),
    }
    config = ZSCORE.model_copy(update={"signal": signal})
    assert evaluate("r", "s", noisy, config) == []
    assert len(evaluate("r", "s", noisy, config.model_copy(update={"use_intervals": False}))) == 1
    tight = noisy | {"mi_estimate_ci_high": steps([1.0] * 5 + [0.2, 0.2, 0.2])}
    (episode,) = evaluate("r", "s", tight, config)
    assert "(the 95% interval of mi_estimate reaches 0.2, under 0.48)" in episode.summary


def test_low_reward_signal_follows_ragens_ten_step_rule():
    std = [0.5] * 5 + [0.04] * 10
    series = {
        "rollout/in_group_reward_std": steps(std),
        "zero_variance_group_ratio": steps([0.1] * 15),
        "rollout/filter_kept_ratio": steps([0.4] * 15),
    }
    (episode,) = evaluate("r", "all", series, ZSCORE)
    assert (episode.rule, episode.fired_step, episode.onset_step) == ("LowRewardSignal", 15, 6)
    assert "top_p" in episode.description
    assert "On step 15 a top_p 0.9 filter would keep 40% of the groups." in episode.description
    nine = {k: v[:14] for k, v in series.items()}
    assert evaluate("r", "all", nine, ZSCORE)[0].state == "pending"


def test_many_zero_variance_groups_raise_low_reward_signal_sooner():
    series = {
        "rollout/in_group_reward_std": steps([0.5] * 8),
        "zero_variance_group_ratio": steps([0.1] * 5 + [0.75] * 3),
    }
    (episode,) = evaluate("r", "all", series, ZSCORE)
    assert (episode.fired_step, episode.state) == (8, "firing")
    assert "75% of prompt groups without reward variance" in episode.summary


def test_rules_can_be_disabled_and_tuned_per_run():
    series = template_series([4.0] * 5 + [1.0] * 3)
    assert evaluate("r", "s", series, ZSCORE.model_copy(update={"enabled": False})) == []
    assert evaluate("r", "s", series, ZSCORE.model_copy(update={"drop_fraction": 0.9})) == []  # 1.0 is not below 0.4
    assert evaluate("r", "s", series, ZSCORE.model_copy(update={"window": 5}))[0].state == "pending"


@pytest.mark.parametrize(("field", "value"), [("drop_fraction", 0), ("window", 0), ("entropy_floor", 1.5)])
def test_invalid_thresholds_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        AlertSettings(**{field: value})


def test_no_reasoning_fires_after_window_batches_without_reasoning_and_resolves_when_it_returns():
    series = {
        "valid_thinking_rate": steps([0.9, 0.0, 0.0, 0.0, 0.0, 0.5, 0.6]),
        "truncated_think_ratio": steps([0.0, 0.4, 0.4, 0.5, 0.6, 0.1, 0.0]),
    }
    (episode,) = evaluate("r", "all", series, ZSCORE)
    assert (episode.rule, episode.severity, episode.onset_step, episode.fired_step, episode.resolved_step) == (
        "NoReasoning",
        "warning",
        2,
        4,
        7,
    )
    assert "no turn carried reasoning to score in 4 batches in a row (since step 2)" in episode.summary
    assert "reasoning_extraction" in episode.description
    firing = {k: v[:5] for k, v in series.items()}
    (episode,) = evaluate("r", "all", firing, ZSCORE)
    assert episode.state == "firing"
    assert episode.summary.endswith("60% of the last batch's turns opened a think block and never closed it")


def test_no_reasoning_stays_quiet_while_some_turn_carries_reasoning():
    series = {"valid_thinking_rate": steps([0.0, 0.0, 0.1, 0.0, 0.0, 0.05])}
    assert evaluate("r", "all", series, ZSCORE) == []


def cusum_series(mi, se=0.05, entropy=2.0):
    n = len(mi)
    return {
        "mi_estimate": steps(mi),
        "mi_estimate_se": steps([se] * n),
        "conditional_entropy_est": steps([entropy] * n),
    }


def test_the_cusum_fires_on_a_sustained_drop_that_a_level_rule_misses_and_says_so():
    # A quarter of the MI lost (as when a quarter of the prompts collapse): 0.6 -> 0.45, se 0.05.
    mi = [0.6, 0.62, 0.58, 0.61, 0.59] + [0.6, 0.58] + [0.45] * 8
    config = AlertSettings(signal="mi_cusum", cusum_drop=0.25, cusum_threshold=4.0, window=1)
    (episode,) = evaluate("r", "s", cusum_series(mi), config, lost=[3, 7])
    # Each low step adds (0.6 - 0.075 - 0.45) / 0.05 = 1.5; above 4 at the third low step (step 10).
    assert (episode.onset_step, episode.fired_step) == (10, 10)
    assert "mi_estimate 0.45 fell from its baseline 0.6" in episode.summary
    assert "lost input dependence: 3, 7" in episode.summary
    level = config.model_copy(update={"signal": "mi_estimate", "drop_fraction": 0.4})
    assert evaluate("r", "s", cusum_series(mi), level) == []


def test_the_cusum_stays_quiet_on_noise_around_the_baseline_and_without_standard_errors():
    mi = [0.6, 0.62, 0.58, 0.61, 0.59, 0.55, 0.65, 0.57, 0.6, 0.56, 0.62]
    assert evaluate("r", "s", cusum_series(mi), AlertSettings(signal="mi_cusum")) == []
    no_se = {k: v for k, v in cusum_series([0.6] * 5 + [0.0] * 5).items() if k != "mi_estimate_se"}
    assert evaluate("r", "s", no_se, AlertSettings(signal="mi_cusum")) == []


def random_history(rng, n_steps, sampler):
    """Series with regimes (healthy, input dependence gone, entropy gone, rewards flat, no reasoning),
    each series missing at some steps."""
    series: dict[str, list[tuple[int, float]]] = {}
    regime = 0
    for step in range(1, n_steps + 1):
        regime = rng.randrange(5) if rng.random() < 0.1 else regime
        values = run_figures(rng, regime) if sampler == "all" else model_figures(rng, regime)
        for name, value in values.items():
            if rng.random() < 0.93:
                series.setdefault(name, []).append((step, value))
    return series


def after(series, done, upto):
    return {name: [(s, v) for s, v in points if done < s <= upto] for name, points in series.items()}


def reconcile_whole(stored, episodes):
    """What storage keeps after a whole replay (alert_state): pending and dropped episodes that vanished go,
    others stay."""
    found = {(e.rule, e.onset_step): e for e in episodes}
    kept = {key: e for key, e in stored.items() if key in found or e.state not in ("pending", "dropped")}
    return kept | found


def replayed(sampler, series, config, lost):
    """Every episode a whole replay gives, the dropped ones too (what storage records)."""
    replay = Replay("r", sampler, config)
    replay.feed(series)
    return replay.episodes(lost) + replay.dropped


@pytest.mark.parametrize("seed", range(12))
def test_resuming_a_replay_from_its_saved_state_gives_what_the_whole_history_gives(seed):
    rng = random.Random(seed)
    sampler = "all" if seed % 3 == 0 else "first_turn"
    config = AlertSettings(
        signal=rng.choice(["retrieval_above_chance", "mi_cusum", "mi_zscore_ema", "mi_estimate"]),
        baseline_steps=rng.choice([1, 3, 5]),
        window=rng.choice([1, 2, 3]),
        resolve_window=rng.choice([1, 2]),
        reward_window=rng.choice([2, 10]),
        use_intervals=rng.random() < 0.5,
        entropy_signal=rng.choice(["conditional_entropy_est", "token_entropy_mean"]),
        cusum_threshold=2.0,
    )
    n_steps = 300
    series = random_history(rng, n_steps, sampler)
    stored: dict[tuple[str, int], Episode] = {}
    whole: dict[tuple[str, int], Episode] = {}
    state, done = None, 0
    while done < n_steps:
        upto, lost = min(n_steps, done + rng.choice([1, 1, 2, 7])), rng.choice([None, [], [2, 5]])
        try:
            replay = Replay("r", sampler, config, state)
            replay.feed(after(series, done, upto))
            stored |= {(e.rule, e.onset_step): e for e in replay.episodes(lost) + replay.dropped}
        except Rewind:  # the intervals appeared late: the history is replayed, as storage then does
            replay = Replay("r", sampler, config)
            replay.feed(after(series, 0, upto))
            stored = reconcile_whole(stored, replay.episodes(lost) + replay.dropped)
        state = json.loads(json.dumps(replay.state()))  # stored as JSON between steps
        whole = reconcile_whole(whole, replayed(sampler, after(series, 0, upto), config, lost))
        assert stored == whole, f"after step {upto}"
        done = upto
    assert whole  # the history raised alerts


def test_intervals_that_appear_after_steps_were_judged_without_them_rewind_the_replay():
    config = ZSCORE.model_copy(update={"window": 1})
    history = template_series([4.0] * 5 + [1.0] * 5) | {
        "mi_estimate": steps([0.6] * 10),
        "mi_estimate_ci_high": [(9, 0.9), (10, 0.9)],
    }
    replay = Replay("r", "s", config)
    replay.feed(after(history, 0, 8))  # no interval yet: the drop counts without the noise guard
    assert [e.state for e in replay.episodes()] == ["firing"]
    with pytest.raises(Rewind):
        Replay("r", "s", config, json.loads(json.dumps(replay.state()))).feed(after(history, 8, 10))
    assert evaluate("r", "s", history, config) == []  # with the noise guard none of the steps counts


@pytest.mark.parametrize("sampler", ["first_turn", "all"])
def test_a_saved_state_lacking_a_rule_or_of_another_shape_is_replayed_from_the_start(sampler):
    config = ZSCORE
    replay = Replay("r", sampler, config)
    replay.feed(template_series([4.0] * 6) | {"rollout/in_group_reward_std": steps([0.2] * 6)})
    state = json.loads(json.dumps(replay.state()))
    Replay("r", sampler, config, state)  # the state as saved resumes
    for name in state:  # a rule added since the state was saved must take its baseline from the first steps
        with pytest.raises(Rewind):
            Replay("r", sampler, config, {k: v for k, v in state.items() if k != name})
    reshaped = {name: {**rule, "machine": {**rule["machine"], "latest_inputs": []}} for name, rule in state.items()}
    with pytest.raises(Rewind):
        Replay("r", sampler, config, reshaped)
    renamed_row = {
        name: {**rule, "machine": {**rule["machine"], "latest_row": {"old": 1.0}}} for name, rule in state.items()
    }
    with pytest.raises(Rewind):
        Replay("r", sampler, config, renamed_row)


def test_every_signal_the_schema_accepts_has_a_row_in_the_registry():
    from typing import get_args

    from service.schemas.alerts import SIGNALS, Signal

    assert set(get_args(Signal)) == set(SIGNALS)


def test_a_pending_episode_that_breaks_is_kept_as_a_dropped_record_with_its_figures():
    config = ZSCORE  # window 3: two low steps go pending, the third would fire
    signal = [4.0, 4.2, 3.8, 4.1, 4.0, 3.9, 1.0, 0.9, 3.9, 4.0]
    replay = Replay("ppo-7", "first_turn", config)
    replay.feed(template_series(signal))
    assert replay.episodes() == []
    (dropped,) = replay.dropped
    assert (dropped.rule, dropped.state, dropped.onset_step, dropped.fired_step, dropped.last_step) == (
        "TemplateCollapse",
        "dropped",
        7,
        None,
        8,
    )
    assert dropped.value == 0.9  # the figures of its last held step
    assert dropped.threshold == pytest.approx(2.4)
    assert "fell below 2.4" in dropped.summary
    assert evaluate("ppo-7", "first_turn", template_series(signal), config) == []  # never an alert to act on
