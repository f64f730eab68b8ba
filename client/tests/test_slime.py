"""slime and miles by one flag: ``log_rollout`` called as slime calls it, against a real service.

slime does not install here (it is not on the package index); the samples are slime's ``Sample``
laid out as its rollouts fill them (trainer_writers.Slime, sources cited there).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
from bench.serving import wait_until
from trainer_writers import Sample, Slime, canonical
from wandb_files import wandb_history

from collapse_monitor import Monitor
from collapse_monitor.batches import sample_indices
from collapse_monitor.integrations import slime
from collapse_monitor.slime_samples import trajectories
from collapse_monitor.trackers import NAMES

HERE = Path(__file__).parent


@pytest.fixture
def policy_dir(tmp_path) -> Path:
    from scoring.models import build_tiny_random

    _, tok = build_tiny_random(seed=3)
    folder: Path = tmp_path / "policy"
    tok.save_pretrained(folder)
    return folder


@pytest.fixture
def fresh_monitors():
    """Each test starts as a fresh rollout manager: no monitor of an earlier test is reused."""
    yield
    for figures in slime._feeds.values():
        figures.close()
    slime._feeds.clear()
    for monitor in slime._monitors.values():
        monitor.close(timeout=5)
    slime._monitors.clear()
    slime._decoders.clear()
    slime._warned.clear()


def rollouts(policy_dir: Path, save_dir: Path, env: dict, *ids: int) -> None:
    command = [sys.executable, str(HERE / "slime_rollouts.py"), str(policy_dir), str(save_dir), *map(str, ids)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=180)
    assert done.returncode == 0, done.stderr


def test_each_rollout_reaches_the_service_once_with_groups_rewards_and_turns_across_a_restart(
    service, run_name, tmp_path, policy_dir
):
    env = {**os.environ, "COLLAPSE_MONITOR_URL": service.url, "COLLAPSE_MONITOR_SPOOL_DIR": str(tmp_path / "spool")}
    env.pop("COLLAPSE_MONITOR_RUN", None)
    save_dir = tmp_path / run_name  # --save: names the run when COLLAPSE_MONITOR_RUN is not set
    rollouts(policy_dir, save_dir, env, 1, 2)
    rollouts(policy_dir, save_dir, env, 3, 4)  # the trainer resumed
    batches = service.payloads(run_name)
    assert [b["step"] for b in batches] == [1, 2, 3, 4]
    from transformers import AutoTokenizer

    trainer = Slime(save_dir, AutoTokenizer.from_pretrained(policy_dir))
    for batch in batches:
        assert canonical(batch["trajectories"]) == trainer.expected(batch["step"])


@pytest.mark.usefixtures("fresh_monitors")
def test_token_ids_are_sent_as_the_policy_saw_them(service, run_name, tmp_path, policy_dir, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("COLLAPSE_MONITOR_URL", service.url)
    monkeypatch.setenv("COLLAPSE_MONITOR_RUN", run_name)
    monkeypatch.setenv("COLLAPSE_MONITOR_TOKEN_IDS", "1")
    monkeypatch.setenv("COLLAPSE_MONITOR_SPOOL_DIR", str(tmp_path / "spool"))
    samples = Slime(tmp_path, AutoTokenizer.from_pretrained(policy_dir)).samples(7)
    args = argparse.Namespace(hf_checkpoint=None, save=None, wandb_group=None, reward_key="acc")
    assert slime.log_rollout(7, args, samples, None, 0.1) is False
    assert slime.wait_for_conversions(60)
    assert slime._monitors[(service.url, run_name)].flush(30)
    [batch] = service.payloads(run_name)
    sent = {(t["group_id"], t["reward"]): t["turns"] for t in batch["trajectories"]}
    for s in samples[2:]:  # single-turn: the prompt ids, and the response ids as the reasoning
        n, turns = s.response_length, sent[(s.group_index, cast("dict", s.reward)["acc"])]
        assert turns == [{"prompt_token_ids": s.tokens[:-n], "reasoning_token_ids": s.tokens[-n:]}]
    multi = samples[0]  # two runs of model tokens around the tool's: two turns, the second seeing the first
    mask, n = list(multi.loss_mask or []), multi.response_length
    first_end, second_start = mask.index(0), len(mask) - mask[::-1].index(0)
    prompt, response = multi.tokens[:-n], multi.tokens[-n:]
    assert sent[(multi.group_index, cast("dict", multi.reward)["acc"])] == [
        {"prompt_token_ids": prompt, "reasoning_token_ids": response[:first_end]},
        {"prompt_token_ids": prompt + response[:second_start], "reasoning_token_ids": response[second_start:]},
    ]


@pytest.mark.usefixtures("fresh_monitors")
def test_an_unreachable_service_never_holds_the_rollout_and_loses_nothing(
    service, run_name, tmp_path, policy_dir, monkeypatch
):
    from transformers import AutoTokenizer

    monkeypatch.setenv("COLLAPSE_MONITOR_URL", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setenv("COLLAPSE_MONITOR_RUN", run_name)
    monkeypatch.setenv("COLLAPSE_MONITOR_SPOOL_DIR", str(tmp_path / "spool"))
    trainer = Slime(tmp_path, AutoTokenizer.from_pretrained(policy_dir))
    args = argparse.Namespace(hf_checkpoint=str(policy_dir), save=None, wandb_group=None, reward_key="acc")
    assert slime.log_rollout(1, args, trainer.samples(1)) is False  # returns: the rollout loop goes on
    assert slime.wait_for_conversions(60)
    monitor = slime._monitors[("http://127.0.0.1:9", run_name)]
    assert not monitor.close(timeout=1)  # undelivered: left in the spool
    assert monitor.stats().spooled == 1
    later = Monitor(service.url, run_name, spool_dir=tmp_path / "spool")  # the next start of the run sends it
    assert later.flush(30)
    later.close()
    [batch] = service.payloads(run_name)
    assert (batch["step"], canonical(batch["trajectories"])) == (1, trainer.expected(1))


@pytest.mark.usefixtures("fresh_monitors")
def test_without_a_url_or_with_unreadable_samples_the_trainer_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("COLLAPSE_MONITOR_URL", raising=False)
    args = argparse.Namespace(hf_checkpoint=None, save=None, wandb_group="g", reward_key=None)
    with caplog.at_level(logging.ERROR, logger="collapse_monitor"):
        assert slime.log_rollout(1, args, []) is False
        assert slime.log_rollout(2, args, []) is False
    assert [r.getMessage() for r in caplog.records].count(
        "collapse-monitor: COLLAPSE_MONITOR_URL is not set for the rollout manager; nothing is sent"
    ) == 1
    monkeypatch.setenv("COLLAPSE_MONITOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("COLLAPSE_MONITOR_SPOOL_DIR", str(tmp_path / "spool"))
    bad = [{"group_index": 0, "index": 0, "tokens": [1, 2], "response_length": 1, "reward": {"acc": 1.0}}]
    assert slime.log_rollout(3, args, bad) is False  # a dict reward without --reward-key: counted, not raised
    assert slime.wait_for_conversions(60)
    monitor = slime._monitors[("http://127.0.0.1:9", "g")]
    assert monitor.stats().invalid == 1
    assert "name the key to read (reward_key)" in str(monitor.stats().last_error)


class Recursive:
    """A sample whose every attribute is itself: reading it recurses without end."""

    def __getattr__(self, name: str) -> Recursive:
        return self


class Raising:
    @property
    def tokens(self) -> list[int]:
        raise RuntimeError("a property that raises")


@pytest.mark.usefixtures("fresh_monitors")
def test_odd_samples_and_arguments_are_counted_never_raised_into_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLAPSE_MONITOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("COLLAPSE_MONITOR_SPOOL_DIR", str(tmp_path / "spool"))
    args = argparse.Namespace(hf_checkpoint=None, save=None, wandb_group="odd", reward_key=None)
    nested: dict = {}
    nested["group_index"] = nested
    odd: list[list[Any]] = [
        [object()],
        [Recursive()],
        [Raising()],
        [nested],
        [{"tokens": "not ids", "response_length": "x"}],
    ]
    for rollout_id, samples in enumerate(odd):
        assert slime.log_rollout(rollout_id, args, samples) is False
    # not even a list: logged, not raised
    assert slime.log_rollout(9, args, 12345) is False  # type: ignore[arg-type]
    assert slime.log_rollout(10, object(), []) is False
    assert slime.wait_for_conversions(60)
    assert slime._monitors[("http://127.0.0.1:9", "odd")].stats().invalid == len(odd)


@pytest.mark.usefixtures("fresh_monitors")
def test_a_rollout_of_100000_samples_sends_4096_in_whole_groups_reads_no_other_and_counts_them(
    service, run_name, tmp_path, monkeypatch
):
    monkeypatch.setenv("COLLAPSE_MONITOR_URL", service.url)
    monkeypatch.setenv("COLLAPSE_MONITOR_RUN", run_name)
    monkeypatch.setenv("COLLAPSE_MONITOR_SPOOL_DIR", str(tmp_path / "spool"))
    groups = [i // 8 for i in range(100_000)]  # 12,500 prompts of 8 samples, as slime numbers them
    kept = set(sample_indices(groups, max_groups=None, max_rows=slime.MAX_ROWS, seed=0, step=5))
    samples = [
        Sample(group_index=g, index=i, prompt=f"prompt {g}", response=f"answer {i}", response_length=3, reward=i % 2)
        if i in kept  # the others would fail the rollout if they were read: their length is not a number
        else Sample(group_index=g, index=i, response_length=cast("int", "unreadable"))
        for i, g in enumerate(groups)
    ]
    args = argparse.Namespace(hf_checkpoint=None, save=None, wandb_group=None, reward_key=None)
    assert slime.log_rollout(5, args, samples) is False
    assert slime.wait_for_conversions(300)
    assert slime._monitors[(service.url, run_name)].flush(60)
    [batch] = service.payloads(run_name)  # taken: within the service's 4096 trajectories
    sent = batch["trajectories"]
    assert len(sent) == slime.MAX_ROWS == 4096
    assert {t["turns"][0]["response"] for t in sent} == {f"answer {i}" for i in kept}
    per_group = {t["group_id"]: sum(s["group_id"] == t["group_id"] for s in sent) for t in sent}
    assert set(per_group.values()) == {8}  # whole groups: each prompt's reward spread intact
    stats = slime._monitors[(service.url, run_name)].stats()
    assert (stats.rows_sampled_out, stats.rows_left_out) == (100_000 - 4096, 0)  # the hook's draw, counted


@pytest.mark.usefixtures("fresh_monitors")
def test_a_sample_of_2000_tool_turns_sends_its_first_turns_within_the_services_limits(
    service, run_name, tmp_path, monkeypatch
):
    monkeypatch.setenv("COLLAPSE_MONITOR_URL", service.url)
    monkeypatch.setenv("COLLAPSE_MONITOR_RUN", run_name)
    monkeypatch.setenv("COLLAPSE_MONITOR_TOKEN_IDS", "1")
    monkeypatch.setenv("COLLAPSE_MONITOR_SPOOL_DIR", str(tmp_path / "spool"))
    mask = [1] * 8 + ([0] * 8 + [1] * 8) * 2000  # a model run, then 2,000 tool observations each answered
    prompt = list(range(10, 74))
    samples = [
        Sample(
            group_index=0,
            index=k,
            tokens=prompt + [(k + i) % 400 + 5 for i in range(len(mask))],
            response_length=len(mask),
            loss_mask=mask,
            reward=float(k),
            status=Sample.Status.COMPLETED,
        )
        for k in range(2)
    ]
    args = argparse.Namespace(hf_checkpoint=None, save=None, wandb_group=None, reward_key=None)
    assert slime.log_rollout(1, args, samples) is False
    assert slime.wait_for_conversions(120)
    assert slime._monitors[(service.url, run_name)].flush(60)
    [batch] = service.payloads(run_name)
    for sample, sent in zip(samples, sorted(batch["trajectories"], key=lambda t: t["reward"])):
        # naively: turn k reads the prompt and every response token before its run; turns are kept while
        # all of them together hold at most 65,536 ids (the service's max_token_ids)
        response, expected, n_ids = sample.tokens[64:], [], 0
        for start in range(0, len(mask), 16):
            n_ids += 64 + start + 8
            if n_ids > 65_536:
                break
            expected.append(
                {"prompt_token_ids": prompt + response[:start], "reasoning_token_ids": response[start : start + 8]}
            )
        assert 60 < len(expected) < 2000
        assert sent["turns"] == expected


def test_a_sample_keeps_at_most_256_turns():
    mask = [1, 0] * 2000
    sample = {
        "group_index": 0,
        "index": 0,
        "tokens": [7, *range(len(mask))],
        "response_length": len(mask),
        "loss_mask": mask,
    }
    [trajectory] = trajectories([sample], token_ids=True, max_token_ids=10**9)
    assert [t["reasoning_token_ids"] for t in trajectory["turns"]] == [[2 * k] for k in range(256)]


def wandb_hook_env(monkeypatch, url: str, run: str, spool: Path) -> None:
    """The environment slime's Ray job would give the hook, W&B quiet and the figures polled every 0.1 s."""
    for name, value in {
        "WANDB_SILENT": "true",
        "COLLAPSE_MONITOR_URL": url,
        "COLLAPSE_MONITOR_RUN": run,
        "COLLAPSE_MONITOR_SPOOL_DIR": str(spool),
        "COLLAPSE_MONITOR_WANDB_POLL_SECONDS": "0.1",
    }.items():
        monkeypatch.setenv(name, value)


def slime_wandb_run(folder: Path, project: str) -> Any:
    """The rollout manager's W&B run as slime opens it offline: ``init_wandb_secondary``, then the axes of
    ``_init_wandb_common`` that its rollout figures use (slime/observability/wandb_utils.py, THUDM/slime
    624b824a898ab0ec1fcb4d373004c7f3852bf515)."""
    import wandb

    run = wandb.init(project=project, dir=folder, settings=wandb.Settings(mode="offline"))
    wandb.define_metric("rollout/step")
    wandb.define_metric("rollout/*", step_metric="rollout/step")
    return run


@pytest.mark.usefixtures("fresh_monitors")
def test_with_use_wandb_the_scored_figures_join_slimes_run_at_their_rollouts_step(
    service, run_name, tmp_path, monkeypatch, policy_dir
):
    wandb = pytest.importorskip("wandb")
    from transformers import AutoTokenizer

    wandb_hook_env(monkeypatch, service.url, run_name, tmp_path / "spool")
    trainer = Slime(tmp_path, AutoTokenizer.from_pretrained(policy_dir))
    args = argparse.Namespace(
        hf_checkpoint=str(policy_dir), save=None, wandb_group=None, reward_key="acc", use_wandb=True,
        wandb_always_use_train_step=True, rollout_batch_size=3, n_samples_per_prompt=2, global_batch_size=3,
    )  # fmt: skip
    slime_step = {rollout_id: rollout_id * 3 * 2 // 3 for rollout_id in range(1, 5)}  # compute_rollout_step
    slime_wandb_run(tmp_path, run_name)
    for rollout_id in (1, 2, 3, 4):
        assert slime.log_rollout(rollout_id, args, trainer.samples(rollout_id), {}, 1.0) is False
        # slime's log_rollout_data then logs its own figures, since the function returned False
        wandb.log({"rollout/raw_reward": 0.5, "rollout/step": slime_step[rollout_id]})
        if rollout_id == 3:  # rollouts 1-3 scored and fetched before rollout 4: its call writes them
            service.wait_until_processed(run_name, 3)
            figures = slime._feeds[(service.url, run_name)]
            wait_until(lambda: figures.next_step > 3, 60, "steps 1-3 fetched")  # noqa: B023  # called at once
    wandb.finish()

    stored = {
        (slime_step[point["step"]], f"collapse/{point['sampler']}/{point['name']}"): point["value"]
        for point in slime._monitors[(service.url, run_name)].metrics(NAMES, to_step=3)
    }
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, axes = wandb_history(run_file)
    collapse_rows = [row for row in history if "collapse/step" in row]
    assert [row["collapse/step"] for row in collapse_rows] == [2, 4, 6]  # in step order, at slime's steps
    written_names = {name for _, name in stored}
    written = {
        (row["collapse/step"], name): value
        for row in collapse_rows
        for name, value in row.items()
        if name in written_names
    }
    assert written == pytest.approx(stored)
    assert len(stored) >= 3 * len(NAMES)
    defined = {
        axes[name] for row in collapse_rows for name in row if name.startswith("collapse/") and name != "collapse/step"
    }
    assert defined == {"collapse/step"}
    assert axes["rollout/*"] == "rollout/step"  # slime's own series keep their axis
    assert [row["rollout/step"] for row in history if "rollout/step" in row] == [2, 4, 6, 8]


@pytest.mark.usefixtures("fresh_monitors")
def test_with_use_wandb_and_the_service_down_slimes_logging_goes_on_unchanged(tmp_path, monkeypatch, policy_dir):
    wandb = pytest.importorskip("wandb")
    from transformers import AutoTokenizer

    wandb_hook_env(monkeypatch, "http://127.0.0.1:9", "down", tmp_path / "spool")  # nothing listens
    trainer = Slime(tmp_path, AutoTokenizer.from_pretrained(policy_dir))
    args = argparse.Namespace(
        hf_checkpoint=str(policy_dir), save=None, wandb_group=None, reward_key="acc", use_wandb=True
    )
    slime_wandb_run(tmp_path, "down")
    for rollout_id in (1, 2, 3):
        assert slime.log_rollout(rollout_id, args, trainer.samples(rollout_id), {}, 1.0) is False
        wandb.log({"rollout/raw_reward": 0.5, "rollout/step": rollout_id})
        wait_until(
            lambda n=rollout_id: slime._monitors[("http://127.0.0.1:9", "down")].stats().read_errors >= 2 * n,
            60,
            "polled",
        )
    wandb.finish()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, _ = wandb_history(run_file)
    assert [{k: v for k, v in row.items() if not k.startswith("_")} for row in history] == [
        {"rollout/raw_reward": 0.5, "rollout/step": step} for step in (1, 2, 3)
    ]
