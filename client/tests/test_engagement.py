"""When the SNR filter acts, by a real service's alerts: TemplateCollapse firing engages it (not a noisy
LowRewardSignal step, not pending), an alert open before a restarted job watched engages it too, and
``disengage="on_resolve"`` ends it with the episode. The alerts are the service's own rules on the matrices
``alert_matrices`` posts; the engagement reads the monitor's one alert watcher."""

from __future__ import annotations

import logging

from alert_matrices import ALERTS, polls_after, post_matrices, states, wait_for

from collapse_monitor import AlertEvent, FilterEngagement, Monitor
from collapse_monitor.snr_filter import SNRFilter

ON_ALERT = SNRFilter(engage="on_alert")  # the defaults: TemplateCollapse firing, stay engaged


def flat(step: int) -> list[dict]:
    """One prompt group whose rewards do not spread: every group at zero spread, LowRewardSignal's pending step."""
    return [
        {
            "group_id": 0,
            "reward": 1.0,
            "prompt": "<|im_start|>user\nPuzzle 0: reach the goal.<|im_end|>\n<|im_start|>assistant\n",
            "response": f"<think>Step {step}, try {k}: go up.</think>Up",
        }
        for k in range(2)
    ]


def test_the_default_engages_at_template_collapse_firing_not_at_a_low_reward_step_nor_pending(
    service, run_name, tmp_path
):
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, alerts=ALERTS, strict=True)
    seen: list[AlertEvent] = []
    monitor.on_alert(seen.append, interval=0.1)  # every rule, pending and firing: what the service said
    engagement = FilterEngagement.watch(monitor, ON_ALERT, interval=0.1)
    resolving = FilterEngagement.watch(monitor, SNRFilter(engage="on_alert", disengage="on_resolve"), interval=0.1)
    polls_after(monitor, 1)

    monitor.log(1, flat(1))
    assert monitor.flush(30)
    wait_for(lambda: any(e.rule == "LowRewardSignal" for e in seen), what="LowRewardSignal pending")
    post_matrices(service.url, run_name, {1: False, 2: True})  # TemplateCollapse pending at 2
    wait_for(lambda: any(e.rule == "TemplateCollapse" for e in seen), what="TemplateCollapse pending")
    polls_after(monitor)
    assert [(e.rule, e.state) for e in seen] == [("LowRewardSignal", "pending"), ("TemplateCollapse", "pending")]
    assert not engagement.update(2)
    assert not resolving.update(2)

    post_matrices(service.url, run_name, {3: True})  # firing at 3
    wait_for(lambda: engagement.update(3), what="engaged at firing")
    assert resolving.update(3)
    [(step, event)] = engagement.history
    assert (step, event.rule, event.state, event.step) == (3, "TemplateCollapse", "firing", 3)

    post_matrices(service.url, run_name, {4: False})  # resolved at 4
    wait_for(lambda: not resolving.update(5), what="disengaged at resolved")
    assert engagement.update(5)  # the default stays engaged
    assert [(step, e.state) for step, e in resolving.history] == [(3, "firing"), (5, "resolved")]
    monitor.close()


def test_a_restarted_job_with_an_open_alert_engages_and_is_not_stopped_again(service, run_name, tmp_path, caplog):
    """The first job's TemplateCollapse fired and is still open when the second job, on the same run, starts
    watching: the filter engages at its first step; stop_on does not stop it again for the same episode
    (a job resumed from before the collapse would stop before the service saw its new history)."""
    first = Monitor(service.url, run_name, spool_dir=tmp_path / "first", alerts=ALERTS, strict=True)
    post_matrices(service.url, run_name, {1: False, 2: True, 3: True})
    first.close()

    restarted = Monitor(service.url, run_name, spool_dir=tmp_path / "second", alerts=ALERTS, strict=True)
    engagement = FilterEngagement.watch(restarted, ON_ALERT, interval=0.1)
    actions = restarted.act_on_alerts(stop_on=("firing",), interval=0.1)
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        polls_after(restarted, 2)
        assert engagement.update(1)
        assert not restarted.should_stop(1)
    [(step, event)] = engagement.history
    assert (step, event.state, event.step, event.is_open_at_start) == (1, "firing", 3, True)
    assert actions.history == []
    assert "was open before this process watched: not acted on at training step 1" in caplog.text

    post_matrices(service.url, run_name, {4: False, 5: True, 6: True})  # a new episode, seen while it trains
    wait_for(lambda: restarted.should_stop(6), what="the stop at the new episode's firing")
    assert [(d.save, d.stop, *states(d.events)) for _, d in actions.history] == [
        (True, False, ("TemplateCollapse", "matrix", "pending", 5)),
        (False, True, ("TemplateCollapse", "matrix", "firing", 6)),
    ]
    restarted.close()


def test_on_alert_without_a_watcher_warns_where_it_is_set_up(tmp_path, caplog):
    disabled = Monitor("http://127.0.0.1:9", "r", spool_dir=tmp_path, enabled=False)
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        engagement = FilterEngagement.watch(disabled, ON_ALERT)
    assert not engagement.engaged
    assert "engage='on_alert' has no alert watcher (the monitor is disabled): the filter never engages" in caplog.text
