"""SNRFilter's settings are checked where the filter is built, naming the setting; FilterEngagement reads the
alert events its watcher queued, engages once, and stays engaged. (The selections themselves are held to the
service's in tests/unit/test_snr_filter_copies.py.)"""

from __future__ import annotations

import logging

import pytest

from collapse_monitor.alerts import AlertEvent
from collapse_monitor.engagement import FilterEngagement, fan_out, union_filters
from collapse_monitor.snr_filter import SNRFilter


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
        ({"variant": "trl"}, "SNRFilter variant must be one of ragen, upstream, got 'trl'"),
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
        ({"ddof": 0}, r"SNRFilter ddof applies to variant 'upstream' only \(RAGEN's std uses n-1\), got 0"),
        ({"variant": "upstream", "ddof": -1}, "SNRFilter ddof must be a whole number >= 0, got -1"),
        ({"selection_eps": -0.1}, "SNRFilter selection_eps must be a number >= 0, got -0.1"),
        ({"engage": "sometimes"}, "SNRFilter engage must be one of always, on_alert, got 'sometimes'"),
        ({"states": ("burning",)}, "states must be among pending, firing, resolved, got burning"),
        ({"engage": "on_alert", "states": ()}, "SNRFilter states must name at least one of pending, firing, resolved"),
        ({"include_zero": "yes"}, "SNRFilter include_zero must be True, False or None, got 'yes'"),
    ],
)
def test_a_bad_setting_is_refused_where_the_filter_is_built_naming_it(settings, message):
    with pytest.raises(ValueError, match=message):
        SNRFilter(**settings)


def test_defaults_are_ragens_and_zero_spread_groups_follow_the_variant():
    snr = SNRFilter()
    assert (snr.variant, snr.strategy, snr.value, snr.engage) == ("ragen", "top_p", 0.9, "always")
    assert (snr.rules, snr.states) == (("LowRewardSignal", "TemplateCollapse"), ("pending",))
    assert snr.keeps_zero_spread
    assert not SNRFilter(variant="upstream").keeps_zero_spread
    assert SNRFilter(variant="upstream", include_zero=True).keeps_zero_spread
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
    assert engagement.update(4) is None
    assert not engagement.engaged
    firing = event("TemplateCollapse", "firing", step=5)
    engagement(firing)
    engagement(event("TemplateCollapse", "firing", step=5, alert_id=2))  # a second sampler's episode
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        assert engagement.update(6) == firing
    assert engagement.engaged
    assert engagement.history == [(6, firing)]
    assert (
        "TemplateCollapse on sampler first_turn (critical) firing at step 5 (alert 1): SNR filter engaged at "
        in caplog.text
    )
    engagement(event("TemplateCollapse", "resolved", step=9))
    assert engagement.update(10) is None
    assert engagement.engaged  # once engaged, it stays engaged


def test_always_is_engaged_from_the_start():
    assert FilterEngagement(SNRFilter()).engaged


def test_one_watcher_serves_several_callbacks_with_the_union_of_what_they_want():
    seen: list[tuple[str, str]] = []
    deliver = fan_out(lambda e: seen.append(("a", e.state)), lambda e: seen.append(("b", e.state)))
    deliver(event("TemplateCollapse", "pending"))
    assert seen == [("a", "pending"), ("b", "pending")]
    assert union_filters((frozenset({"TemplateCollapse"}), {"pending"}), (("LowRewardSignal",), ("firing",))) == (
        frozenset({"TemplateCollapse", "LowRewardSignal"}),
        frozenset({"pending", "firing"}),
    )
    assert union_filters((None, {"pending"}), (("LowRewardSignal",), ("firing",)))[0] is None  # None: every rule
