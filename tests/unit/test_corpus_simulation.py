"""The corpus simulations (bench/corpus/simulate.py) and the CUSUM signal, on a small made-up corpus."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.corpus.calibrate import first_fire, replay
from bench.corpus.simulate import SHARP_SHARE, Corpus, Run, Story, halves, story
from scoring.estimators import between_step_variance, cusum, lost_input_dependence
from service.alerts.rules import evaluate
from service.schemas.alerts import AlertSettings

PROMPTS, PER_PROMPT, STYLES, PER_STYLE, LENGTH = 8, 16, 2, 16, 20


def made_up_corpus(seed: int = 0) -> Corpus:
    """Healthy traces score -2 nats/token under their own prompt and -3 under the others; template
    traces -2.6 under every task prompt and -2 under their own template prompt."""
    rng = np.random.default_rng(seed)
    n_healthy, n_template = PROMPTS * PER_PROMPT, STYLES * PER_STYLE
    prompt_of = np.r_[np.repeat(np.arange(PROMPTS), PER_PROMPT), -np.ones(n_template, dtype=int)]
    style_of = np.r_[-np.ones(n_healthy, dtype=int), np.repeat(np.arange(STYLES), PER_STYLE)]
    per_token = np.full((n_healthy + n_template, PROMPTS + STYLES), -3.0)
    per_token[np.arange(n_healthy), prompt_of[:n_healthy]] = -2.0
    per_token[n_healthy:, :PROMPTS] = -2.6
    per_token[np.arange(n_healthy, n_healthy + n_template), PROMPTS + style_of[n_healthy:]] = -2.0
    per_token += rng.normal(0, 0.1, per_token.shape)
    lengths = np.full(n_healthy + n_template, LENGTH)
    return Corpus(
        L_seq=per_token * LENGTH,
        lengths=lengths,
        entropy=tuple(np.full(LENGTH, 2.0) for _ in lengths),
        prompt_of_trace=prompt_of,
        style_of_trace=style_of,
        n_prompts=PROMPTS,
        n_styles=STYLES,
        raw={},
    )


def test_halves_split_the_prompts_into_even_and_odd():
    assert halves(6) == {"calibration": (0, 2, 4), "evaluation": (1, 3, 5)}


def test_shares_follow_each_story():
    assert Story("sharp", 10).share(9) == 0
    assert Story("sharp", 10).share(10) == SHARP_SHARE
    gradual = Story("gradual", 10)
    assert [gradual.share(s) for s in (10, 11, 12, 13)] == [0.125, 0.25, 0.375, 0.5]
    assert gradual.half_step() == 13
    assert Story("partial", 5).share(5) == 1.0


def test_a_healthy_step_sends_the_same_rows_per_prompt_each_from_its_own_traces():
    corpus = made_up_corpus()
    prompts = halves(PROMPTS)["evaluation"]
    payload = Run(corpus, prompts, 16, story("healthy", prompts, None, np.random.default_rng(0)), seed=1).step(1)
    assert payload["row_group_ids"] == [p for p in prompts for _ in range(4)]
    L = np.array(payload["L_seq"]) / LENGTH
    own = [prompts.index(g) for g in payload["row_group_ids"]]
    assert np.allclose(L[np.arange(16), own], -2.0, atol=0.5)
    assert [len(e) for e in payload["token_entropy"]] == payload["reasoning_lengths"]


def test_partial_collapse_sends_template_rows_only_for_its_prompts_and_they_earn_nothing():
    corpus = made_up_corpus()
    prompts = halves(PROMPTS)["calibration"]
    s = story("partial", prompts, 3, np.random.default_rng(0))
    assert len(s.collapsed) == 1
    payload = Run(corpus, prompts, 16, s, seed=2).step(3)
    L = np.array(payload["L_seq"]) / LENGTH
    for r, g in enumerate(payload["row_group_ids"]):
        template = bool(np.allclose(L[r], -2.6, atol=0.3))
        assert template == (g in s.collapsed)
        if template:
            assert payload["rewards"][r] == 0.0


def test_mixture_rows_are_scored_under_the_mixture_policy():
    corpus = made_up_corpus()
    prompts = halves(PROMPTS)["evaluation"]
    run = Run(corpus, prompts, 8, Story("mixture", 1, prompts), seed=3)
    rng_state = run.rng.bit_generator.state
    payload = run.step(1)
    # Replaying the same draws without the mixture gives the plain entries.
    plain = Run(corpus, prompts, 8, Story("sharp", 1, prompts), seed=3)
    plain.rng.bit_generator.state = rng_state
    plain.style = run.style
    base = np.array(plain.step(1)["L_seq"])
    rows = [int(np.flatnonzero((corpus.L_seq[:, list(prompts)] == b).all(axis=1))[0]) for b in base]
    L_T = corpus.L_seq[rows, corpus.template_column(run.style)][:, None]
    expected = np.logaddexp(math.log(1 - SHARP_SHARE) + base, math.log(SHARP_SHARE) + L_T)
    assert np.allclose(payload["L_seq"], expected)


def test_cusum_accumulates_standardized_shortfalls_and_resets_at_zero():
    # baseline 1, drop 0.4: each step below 0.8 adds (0.8 - value) / se.
    assert cusum([1.0, 0.5, 0.5, 1.2], [0.1, 0.1, 0.05, 0.1], 1.0, 0.4, 0.0) == pytest.approx([0, 3, 9, 5])
    assert cusum([0.0], [0.0], 1.0, 0.4, se_floor=0.2) == pytest.approx([4.0])


def test_lost_input_dependence_names_columns_far_below_the_retrieved_ones():
    assert lost_input_dependence([0.6, 0.5, 0.02, 0.55], [1.0, 0.75, 0.0, 0.75]) == [False, False, True, False]
    assert lost_input_dependence([0.01, 0.0], [0.25, 0.0]) == [True, True]


@pytest.mark.parametrize("kind", ["sharp", "partial"])
def test_the_default_rule_fires_after_onset_on_collapse_and_stays_quiet_on_healthy_runs(kind):
    corpus = made_up_corpus()
    prompts = halves(PROMPTS)["evaluation"]
    config = AlertSettings()
    healthy = replay(Run(corpus, prompts, 32, Story("healthy", None), seed=4), 30)
    assert first_fire(healthy, config) is None
    s = story(kind, prompts, 15, np.random.default_rng(5))
    collapsed = replay(Run(corpus, prompts, 32, s, seed=5), 30)
    fired = first_fire(collapsed, config)
    assert fired is not None
    assert 15 <= fired <= 15 + (2 if kind == "sharp" else 10)
    if kind == "partial":
        assert collapsed.lost_last == list(s.collapsed)
        episode = [e for e in evaluate("r", "matrix", collapsed.series, config, collapsed.lost_last) if e.fired_step]
        assert f"lost input dependence: {', '.join(map(str, s.collapsed))}" in episode[0].summary


def test_between_step_variance_is_the_spread_beyond_sampling_noise():
    assert between_step_variance([1.0, 1.2, 0.8], [0.1, 0.1, 0.1]) == pytest.approx(0.04 - 0.01)
    assert between_step_variance([1.0, 1.01, 0.99], [0.2, 0.2, 0.2]) == 0.0  # all explained by se
    # tau^2 widens each step's noise: the same dip adds less.
    assert cusum([0.5], [0.1], 1.0, 0.4, 0.0, tau2=0.03) == pytest.approx([3 / 2])
