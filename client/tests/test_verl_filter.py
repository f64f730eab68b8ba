"""The SNR filter on real verl ``DataProto`` batches: masks or kept rows, RAGEN's layout, engagement by a real alert."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch
from test_verl import CHAT_TEMPLATE, grpo_batch, ragen_batch
from tiny_trainer import FIRE_AT_ONCE

from collapse_monitor import Monitor
from collapse_monitor.engagement import FilterEngagement
from collapse_monitor.integrations.verl import apply_snr_filter, log_batch
from collapse_monitor.snr_filter import SNRFilter

# Three prompts of four rows: reward stds 0.5, 1.5 and 0 (n-1), so top_k_abs 1 keeps the second group.
REWARDS = [0.0, 1.0, 0.0, 1.0, 0.0, 3.0, 0.0, 3.0, 2.0, 2.0, 2.0, 2.0]
KEEP_ONE = SNRFilter(strategy="top_k_abs", value=1)


@pytest.fixture(scope="module")
def tokenizer():
    from scoring.models import build_tiny_random

    _, tok = build_tiny_random(seed=2)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def scored_batch(tokenizer, rewards: list[float]):
    """verl's GRPO layout (test_verl.grpo_batch) with these rewards at each response's last token."""
    batch, *_ = grpo_batch(tokenizer, n_prompts=len(rewards) // 4, n=4)
    scores = torch.zeros(batch.batch["responses"].shape)
    last = batch.batch["response_mask"].sum(-1) - 1
    scores[torch.arange(len(rewards)), last] = torch.tensor(rewards)
    batch.batch["token_level_scores"] = scores
    return batch


def test_the_dropped_groups_rows_are_masked_and_nothing_else_changes(tokenizer):
    batch = scored_batch(tokenizer, REWARDS)
    before = {name: batch.batch[name].clone() for name in ("response_mask", "token_level_scores", "responses")}
    filtered = apply_snr_filter(batch, KEEP_ONE, step=1)
    assert filtered.engaged
    assert filtered.kept_rows == [4, 5, 6, 7]
    assert filtered.row_kept.tolist() == [4 <= r < 8 for r in range(12)]
    mask = filtered.batch.batch["response_mask"]
    assert torch.equal(mask[4:8], before["response_mask"][4:8])  # the kept group is unchanged
    assert int(mask[:4].sum()) == int(mask[8:].sum()) == 0
    assert torch.equal(filtered.batch.batch["token_level_scores"], before["token_level_scores"])  # rewards intact
    assert torch.equal(filtered.batch.batch["responses"], before["responses"])
    assert filtered.figures == {
        "rollout/filter_engaged": 1.0,
        "rollout/filter_kept_count": 1.0,
        "rollout/filter_kept_ratio": 1 / 3,
        "rollout/filter_kept_rows": 4.0,
        "rollout/chosen_in_group_reward_std": pytest.approx(math.sqrt(3.0)),
        "rollout/dropped_in_group_reward_std": pytest.approx(math.sqrt(1 / 3) / 2),
        "rollout/filter_skipped": 0.0,
    }


def test_select_keeps_the_kept_groups_rows_alone_with_their_columns(tokenizer):
    batch = scored_batch(tokenizer, REWARDS)
    uids = list(batch.non_tensor_batch["uid"])
    filtered = apply_snr_filter(batch, SNRFilter(strategy="top_k_abs", value=2), step=1, output="select")
    assert filtered.kept_rows == [0, 1, 2, 3, 4, 5, 6, 7]
    kept = filtered.batch
    assert len(kept) == 8
    assert list(kept.non_tensor_batch["uid"]) == uids[:8]
    assert torch.equal(kept.batch["responses"], batch.batch["responses"][:8])


def test_the_upstream_variant_ranks_by_variance_and_drops_zero_variance_groups_at_top_p_1(tokenizer):
    batch = scored_batch(tokenizer, REWARDS)
    filtered = apply_snr_filter(batch, SNRFilter(variant="upstream", value=1.0), step=1)
    assert filtered.kept_rows == list(range(8))  # the third group has no variance


def test_a_ragen_batch_is_masked_in_its_loss_mask_by_group_ids(tokenizer):
    batch, _, _ = ragen_batch(tokenizer, with_collapse_ids=False)  # rewards 1, 0 | 0.5, 0.5; group_ids 0, 0, 1, 1
    filtered = apply_snr_filter(batch, SNRFilter(variant="upstream", value=0.9), step=1)
    assert filtered.kept_rows == [0, 1]
    assert int(filtered.batch.batch["loss_mask"][2:].sum()) == 0
    assert int(filtered.batch.batch["loss_mask"][:2].sum()) > 0


def test_a_row_without_a_finite_reward_is_left_out_of_its_groups_spread(tokenizer):
    rewards = list(REWARDS)
    rewards[5] = float("nan")  # the second group: 0, nan, 0, 3
    batch = scored_batch(tokenizer, rewards)
    filtered = apply_snr_filter(batch, KEEP_ONE, step=1)
    expected = KEEP_ONE.select([[0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 3.0], [2.0] * 4], rows=[4, 4, 4])
    assert filtered.kept_rows == [4, 5, 6, 7]
    assert filtered.figures["rollout/chosen_in_group_reward_std"] == expected.spreads[1]
    assert filtered.figures["rollout/filter_kept_rows"] == 4.0  # rows, the one without a reward included


def test_what_the_filter_cannot_work_with_is_refused_naming_it(tokenizer):
    batch = scored_batch(tokenizer, REWARDS)
    with pytest.raises(ValueError, match="output must be 'mask' or 'select', got 'drop'"):
        apply_snr_filter(batch, KEEP_ONE, step=1, output="drop")
    with pytest.raises(ValueError, match=r"needs engagement=FilterEngagement.watch\(monitor, snr_filter\)"):
        apply_snr_filter(batch, SNRFilter(engage="on_alert"), step=1)
    with pytest.raises(ValueError, match=r"output='mask' needs loss_agg_mode='token-mean'.*got 'seq-mean-token-mean'"):
        apply_snr_filter(batch, KEEP_ONE, step=1, loss_agg_mode="seq-mean-token-mean")
    assert apply_snr_filter(batch, KEEP_ONE, step=1, output="select", loss_agg_mode="seq-mean-token-sum").engaged
    batch.non_tensor_batch["uid"] = batch.non_tensor_batch["uid"].copy()
    batch.non_tensor_batch["uid"][:] = [str(i) for i in range(12)]
    with pytest.raises(ValueError, match="each of the 12 rows is a group of its own"):
        apply_snr_filter(batch, KEEP_ONE, step=1)
    batch.batch.pop("response_mask")
    with pytest.raises(ValueError, match=r"output='mask' needs a loss mask to zero \(response_mask, loss_mask\)"):
        apply_snr_filter(batch, KEEP_ONE, step=1)


def test_on_alert_the_filter_engages_at_the_first_step_after_a_real_alert_state(service, run_name, tmp_path, tokenizer):
    """The run's TemplateCollapse holds from its first scored step (FIRE_AT_ONCE): pending at step 1, firing at 2.
    Each step waits until the previous one is scored and the watcher has looked twice, as a real step outlasts
    its scoring; the filter engages at step 3, the step after the firing, with no network call of its own."""
    monitor = Monitor(service.url, run_name, spool_dir=tmp_path, alerts=FIRE_AT_ONCE, strict=True)
    snr = SNRFilter(strategy="top_k_abs", value=1, engage="on_alert")  # TemplateCollapse firing
    engagement = FilterEngagement.watch(monitor, snr, interval=0.1)
    engaged = []
    for step in (1, 2, 3):
        if step > 1:
            service.wait_until_processed(run_name, step - 1)
            polls = monitor.stats().alert_polls
            deadline = time.monotonic() + 30
            while monitor.stats().alert_polls < polls + 2 and time.monotonic() < deadline:
                time.sleep(0.02)
        batch = scored_batch(tokenizer, REWARDS)
        log_batch(monitor, step, batch, tokenizer)  # every group, before the filter
        filtered = apply_snr_filter(batch, snr, step=step, engagement=engagement)
        monitor.figures(step, filtered.figures)
        assert monitor.flush(30)
        engaged.append((filtered.engaged, len(filtered.kept_rows)))
    assert engaged == [(False, 12), (False, 12), (True, 4)]
    [(step, event)] = engagement.history
    assert (step, event.rule, event.state, event.step) == (3, "TemplateCollapse", "firing", 2)
    stored = {p["step"]: p["value"] for p in monitor.metrics(["rollout/filter_engaged"], sampler="trainer")}
    assert stored == {1: 0.0, 2: 0.0, 3: 1.0}
    assert [len(p["trajectories"]) for p in service.payloads(run_name)] == [12, 12, 12]
    monitor.close()


def with_advantages(batch):
    """The batch as verl's compute_advantage leaves it for GRPO: each row's reward minus its group's mean, over the
    group's std (n-1), on every response token. (verl's compute_grpo_outcome_advantage does this; its module needs
    codetiming, which this environment lacks.)"""
    rewards = batch.batch["token_level_scores"].sum(-1).view(-1, 4)  # [n_prompts, 4]: four rows per uid, in order
    advantages = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)
    batch.batch["advantages"] = advantages.reshape(-1, 1) * batch.batch["response_mask"]
    return batch


VAGEN = SNRFilter(variant="vagen")  # variances (ddof 0) 0.25, 2.25, 0: 2.25 reaches 0.9 * 2.5, so one group of 3


def test_vagen_scales_the_kept_rows_advantages_by_the_root_of_the_kept_share_in_both_outputs(tokenizer):
    scale = math.sqrt(1 / 3)
    batch = with_advantages(scored_batch(tokenizer, REWARDS))
    before = batch.batch["advantages"].clone()
    assert before[4:8].abs().sum() > 0  # the kept group's advantages are not all 0, so a scale shows
    masked = apply_snr_filter(batch, VAGEN, step=1)
    assert masked.kept_rows == [4, 5, 6, 7]
    advantages = masked.batch.batch["advantages"]
    torch.testing.assert_close(advantages[4:8], before[4:8] * scale)
    assert torch.equal(advantages[:4], before[:4])  # the dropped rows are masked, their advantages left alone
    assert int(masked.batch.batch["response_mask"][:4].sum()) == 0

    batch = with_advantages(scored_batch(tokenizer, REWARDS))
    selected = apply_snr_filter(batch, VAGEN, step=1, output="select")
    assert len(selected.batch) == 4
    torch.testing.assert_close(selected.batch.batch["advantages"], before[4:8] * scale)
    # no variance anywhere: VAGEN keeps every group, unscaled
    flat = with_advantages(scored_batch(tokenizer, [1.0] * 12))
    unchanged = flat.batch["advantages"].clone()
    kept_all = apply_snr_filter(flat, VAGEN, step=1)
    assert (kept_all.kept_rows, kept_all.is_empty) == (list(range(12)), False)
    assert torch.equal(kept_all.batch.batch["advantages"], unchanged)


def test_vagen_is_refused_before_the_advantages_exist_naming_the_setting(tokenizer):
    batch = scored_batch(tokenizer, REWARDS)
    with pytest.raises(ValueError, match=r"variant 'vagen' scales the kept rows' advantages .* right after compute"):
        apply_snr_filter(batch, VAGEN, step=1)


def test_a_step_that_keeps_no_group_says_so_is_warned_each_time_and_the_limit_stops_training(tokenizer, caplog):
    """verl's update cannot be skipped from here: is_empty tells the loop, every time, and the third empty
    selection in a row raises; a step that keeps a group starts the count again."""
    snr = SNRFilter(max_skipped_in_a_row=3)  # RAGEN's linear top_p: no spread, nothing reaches the threshold
    engagement = FilterEngagement(snr)
    flat, spread = [1.0] * 12, REWARDS
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        results = [
            apply_snr_filter(scored_batch(tokenizer, rewards), snr, step=step, engagement=engagement)
            for step, rewards in enumerate([flat, flat, spread, flat, flat], start=1)
        ]
        with pytest.raises(RuntimeError, match=r"kept no group for 3 steps in a row \(up to step 6; max_skipped"):
            apply_snr_filter(scored_batch(tokenizer, flat), snr, step=6, engagement=engagement)
    assert [r.is_empty for r in results] == [True, True, False, True, True]
    assert [r.figures["rollout/filter_skipped"] for r in results] == [1.0, 1.0, 0.0, 1.0, 1.0]
    empty = results[0]
    assert empty.kept_rows == []
    assert int(empty.batch.batch["response_mask"].sum()) == 0
    warned = [r.getMessage() for r in caplog.records if "kept no group for step" in r.getMessage()]
    assert len(warned) == 5  # every empty step, the one that raised included
    assert "step 1: skip its update in the loop (filtered.is_empty)" in warned[0]
    assert "(1 in a row, training stops at 3)" in warned[0]
    assert "(1 in a row, training stops at 3)" in warned[2]  # after step 3 kept a group
    assert (engagement.empty.n_skipped, engagement.empty.n_in_a_row) == (5, 3)
    # select mode leaves no row; without an engagement the warning says nothing is counted across steps
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="collapse_monitor"):
        selected = apply_snr_filter(scored_batch(tokenizer, flat), snr, step=7, output="select")
    assert (selected.is_empty, len(selected.batch)) == (True, 0)
    assert "not counted across steps without engagement=FilterEngagement(snr_filter)" in caplog.text
