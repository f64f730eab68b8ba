"""SNRFilter's settings are checked where the filter is built, naming the setting; FilterEngagement reads the
alert events its watcher queued, engages once, and stays engaged unless told to disengage. (The selections
themselves are held to the service's in tests/unit/test_snr_filter_copies.py; engagement by a real service's
alerts in test_engagement.py.)"""

from __future__ import annotations

import logging

import pytest

from collapse_monitor.alerts import AlertEvent
from collapse_monitor.engagement import FilterEngagement
from collapse_monitor.snr_filter import VARIANTS, SNRFilter


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"strategy": "top_q"},
            r"SNRFilter strategy must be one of top_p, top_k, top_k_abs, min_p \(variant 'ragen'\), got 'top_q'",
        ),
        (
            {"variant": "upstream", "strategy": "min_p"},
            r"strategy must be one of top_p, top_k \(variant 'upstream'\), got 'min_p'",
        ),
        ({"variant": "trl"}, "SNRFilter variant must be one of ragen, upstream, vagen, got 'trl'"),
        (
            {"variant": "vagen", "strategy": "top_k"},
            r"SNRFilter strategy must be one of top_p \(variant 'vagen'\), got 'top_k'",
        ),
        ({"variant": "vagen", "value": 0}, r"value must be in \(0, 1\] for top_p \(a share of the variance\), got 0"),
        ({"variant": "vagen", "top_p_prob_mode": "softmax"}, "SNRFilter top_p_prob_mode applies to variant 'ragen'"),
        (
            {"variant": "vagen", "include_zero": False},
            r"SNRFilter include_zero does not apply to variant 'vagen' \(VAGEN ranks zero-spread groups last",
        ),
        (
            {"variant": "vagen", "selection_eps": 0.01},
            r"SNRFilter selection_eps does not apply to variant 'vagen' \(VAGEN's top_p has no slack\), got 0.01",
        ),
        ({"value": 1.5}, r"SNRFilter value must be in \(0, 1\] for top_p \(a share of the total score\), got 1.5"),
        ({"value": 0}, r"value must be in \(0, 1\] for top_p"),
        ({"strategy": "top_k", "value": 2}, r"value must be in \(0, 1\] for top_k \(a share of the groups\), got 2"),
        ({"strategy": "top_k_abs", "value": 0.5}, "value must be a whole number of groups >= 1 for top_k_abs, got 0.5"),
        ({"strategy": "min_p", "value": 0}, r"value must be in \(0, 1\] for min_p"),
        ({"value": float("nan")}, "SNRFilter value must be a finite number, got nan"),
        ({"value": "0.9"}, "SNRFilter value must be a finite number, got '0.9'"),
        ({"variant": "upstream", "strategy": "top_k", "value": 0}, "whole number of groups >= 1 for top_k, got 0"),
        ({"variant": "upstream", "filter_type": "smallest"}, "SNRFilter filter_type applies to variant 'ragen' only"),
        ({"variant": "upstream", "metric": "reward"}, "SNRFilter metric applies to variant 'ragen' only"),
        ({"ddof": 0}, r"SNRFilter ddof applies to variants 'upstream' and 'vagen' only \(RAGEN's std uses n-1\)"),
        ({"variant": "upstream", "ddof": -1}, "SNRFilter ddof must be a whole number >= 0, got -1"),
        ({"selection_eps": -0.1}, "SNRFilter selection_eps must be a number >= 0, got -0.1"),
        ({"engage": "sometimes"}, "SNRFilter engage must be one of always, on_alert, got 'sometimes'"),
        ({"states": ("burning",)}, "states must be among pending, firing, resolved, dropped, got burning"),
        ({"engage": "on_alert", "states": ()}, "SNRFilter states must name at least one of pending, firing, resolved"),
        ({"disengage": "later"}, "SNRFilter disengage must be one of never, on_resolve, got 'later'"),
        (
            {"disengage": "on_resolve", "states": ("resolved",)},
            "SNRFilter disengage='on_resolve' ends engagement at resolved or dropped: states must be among "
            "pending, firing, got resolved",
        ),
        ({"include_zero": "yes"}, "SNRFilter include_zero must be True, False or None, got 'yes'"),
    ],
)
def test_a_bad_setting_is_refused_where_the_filter_is_built_naming_it(settings, message):
    with pytest.raises(ValueError, match=message):
        SNRFilter(**settings)


def test_defaults_are_ragens_and_zero_spread_groups_follow_the_variant():
    snr = SNRFilter()
    assert (snr.variant, snr.strategy, snr.value, snr.engage) == ("ragen", "top_p", 0.9, "always")
    # engaged by a confirmed collapse, not a noisy step: TemplateCollapse firing, for good
    assert (snr.rules, snr.states, snr.disengage) == (("TemplateCollapse",), ("firing",), "never")
    assert snr.keeps_zero_spread
    assert not SNRFilter(variant="upstream").keeps_zero_spread
    assert SNRFilter(variant="upstream", include_zero=True).keeps_zero_spread
    # each variant's own defaults where its source differs: ddof and the top_p slack
    assert [(SNRFilter(variant=v).variance_ddof, SNRFilter(variant=v).top_p_slack) for v in VARIANTS] == [
        (1, 0.01),
        (1, 0.01),
        (0, 0.0),
    ]
    assert SNRFilter(variant="upstream", ddof=0, selection_eps=0).variance_ddof == 0
    # one name, not its letters (typed as a tuple; a lone name is taken too, as Monitor.on_alert takes it)
    assert SNRFilter(rules="TemplateCollapse").rules == ("TemplateCollapse",)  # type: ignore[arg-type]


def event(rule: str, state: str, step: int = 3, alert_id: int = 1) -> AlertEvent:
    alert = {"rule": rule, "sampler": "first_turn", "state": state, "onset_step": step, "step": step, "id": alert_id}
    return AlertEvent(rule, "first_turn", state, step, step, None, step, alert_id, "critical", "", alert)


def test_engagement_waits_for_a_chosen_rule_and_state_engages_once_and_logs_it(caplog):
    engagement = FilterEngagement(SNRFilter(engage="on_alert", rules=("TemplateCollapse",), states=("firing",)))
    assert not engagement.engaged
    engagement(event("TemplateCollapse", "pending"))  # another state
    engagement(event("EntropyCollapse", "firing"))  # another rule
    assert not engagement.update(4)
    firing = event("TemplateCollapse", "firing", step=5)
    engagement(firing)
    engagement(event("TemplateCollapse", "firing", step=5, alert_id=2))  # a second sampler's episode
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        assert engagement.update(6)
    assert engagement.history == [(6, firing)]
    assert (
        "TemplateCollapse on sampler first_turn (critical) firing at step 5 (alert 1): SNR filter engaged at "
        in caplog.text
    )
    engagement(event("TemplateCollapse", "resolved", step=9))
    assert engagement.update(10)  # once engaged, it stays engaged (disengage="never")


def test_on_resolve_disengages_when_every_episode_that_engaged_it_ended_unless_a_rollback_pinned_it(caplog):
    engagement = FilterEngagement(SNRFilter(engage="on_alert", states=("pending", "firing"), disengage="on_resolve"))
    engagement(event("TemplateCollapse", "pending", step=3, alert_id=1))
    engagement(event("TemplateCollapse", "pending", step=4, alert_id=2))  # a second sampler's episode
    assert engagement.update(4)
    engagement(event("TemplateCollapse", "dropped", step=3, alert_id=1))
    assert engagement.update(5)  # the second episode is still open
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        engagement(event("TemplateCollapse", "resolved", step=4, alert_id=2))
        assert not engagement.update(6)
    assert "resolved at step 4 (alert 2): SNR filter disengaged at training step 6" in caplog.text
    assert [(step, e.state) for step, e in engagement.history] == [(4, "pending"), (6, "resolved")]
    engagement(event("TemplateCollapse", "firing", step=8, alert_id=3))
    assert engagement.update(9)
    engagement.engage(9, None, is_pinned=True)  # a rollback resumes with the filter engaged
    engagement(event("TemplateCollapse", "resolved", step=8, alert_id=3))
    assert engagement.update(10)


def test_always_is_engaged_from_the_start():
    assert FilterEngagement(SNRFilter()).engaged
