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
import time
from pathlib import Path
from typing import Any, cast

import pytest
from trainer_writers import Slime, canonical

from collapse_monitor import Monitor
from collapse_monitor.integrations import slime

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
def test_a_rollout_of_100000_samples_returns_at_once(tmp_path, monkeypatch, policy_dir):
    from transformers import AutoTokenizer

    monkeypatch.setenv("COLLAPSE_MONITOR_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("COLLAPSE_MONITOR_SPOOL_DIR", str(tmp_path / "spool"))
    one = Slime(tmp_path, AutoTokenizer.from_pretrained(policy_dir)).samples(1)
    samples = (one * (100_000 // len(one) + 1))[:100_000]
    args = argparse.Namespace(hf_checkpoint=str(policy_dir), save=None, wandb_group="big", reward_key="acc")
    started = time.perf_counter()
    assert slime.log_rollout(1, args, samples) is False
    assert time.perf_counter() - started < 2.0  # generous: the figure (bench/abuse.py) is a few ms
    assert slime.wait_for_conversions(300)
