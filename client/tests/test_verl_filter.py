"""The SNR filter on real verl ``DataProto`` batches: masks or kept rows, RAGEN's layout, engagement by a real alert."""

from __future__ import annotations

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
