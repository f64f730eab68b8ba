"""TRL with no code change: ``follow`` reads the completion files a real GRPOTrainer writes (log_completions=True).

Each test starts ``collapse-monitor-client follow OUTPUT_DIR`` before the trainer has made the
folder, stops it mid-run, and starts it again once training is over: every generation must reach
the service exactly once, with its groups (identical prompts), prompts (plain text as it is, a
conversation as plain lines; with ``--chat-template-from`` the exact text the trainer generated
from) and rewards (the reward functions' weighted sum), also across the restart.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import datasets
import pytest
from bench.serving import wait_until
from tiny_trainer import NUM_GENERATIONS, RecordingGRPOTrainer, grpo_config, tiny_policy
from transformers import TrainerCallback

from collapse_monitor.cli import main
from collapse_monitor.conversations import render_plain
from collapse_monitor.follow import default_state_path

CLI = Path(sys.executable).parent / "collapse-monitor-client"
WEIGHTS = [1.0, 0.5]


def text_of(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def length_reward(completions, **_kwargs):
    """None (TRL: could not score) for even lengths; TRL writes it as NaN."""
    return [None if len(text_of(c)) % 2 == 0 else len(text_of(c)) / 10 for c in completions]


def parity_reward(completions, **_kwargs):
    """None for lengths divisible by 3, so both are None for lengths divisible by 6."""
    return [None if len(text_of(c)) % 3 == 0 else float(len(text_of(c)) % 2) for c in completions]


def expected_reward(text: str) -> float | None:
    """TRL's total: the weighted sum of the rewards that are not None; None when all are."""
    parts = [w * r for w, [r] in zip(WEIGHTS, (length_reward([text]), parity_reward([text]))) if r is not None]
    return sum(parts) if parts else None


class AtStepEnd(TrainerCallback):  # type: ignore[misc]  # transformers is untyped here
    """Calls ``action`` at the end of optimizer step ``step`` (TRL has written the files of earlier steps)."""

    def __init__(self, step: int, action: Callable[[], None]) -> None:
        self.step = step
        self.action = action

    def on_step_end(self, _args, state, _control, **_kwargs):
        if state.global_step == self.step:
            self.action()


def grpo(output_dir: Path, prompts: list, callback: TrainerCallback, **config) -> RecordingGRPOTrainer:
    model, tokenizer = tiny_policy()
    args = grpo_config(
        output_dir,
        **{
            "max_completion_length": 10,
            "max_steps": 4,
            "learning_rate": 1e-3,
            "log_completions": True,
            "save_strategy": "no",
            "reward_weights": WEIGHTS,
        }
        | config,
    )
    return RecordingGRPOTrainer(
        model=model,
        reward_funcs=[length_reward, parity_reward],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[callback],
    )


class Follower:
    """The command, as a user runs it next to the trainer."""

    def __init__(self, service, run: str, folder: Path, spool: Path, *options: str) -> None:
        self.command = [
            str(CLI), "follow", str(folder), "--url", service.url, "--run", run, "--spool-dir", str(spool),
            "--reward-weights", ",".join(map(str, WEIGHTS)), *options,
        ]  # fmt: skip
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen([*self.command, "--poll", "0.2"], stdout=subprocess.PIPE, text=True)

    def stop(self) -> list[int]:
        assert self.process is not None
        self.process.terminate()
        out, _ = self.process.communicate(timeout=60)
        assert self.process.returncode == 0
        return list(json.loads(out)["steps"])

    def once(self) -> list[int]:
        done = subprocess.run([*self.command, "--once"], capture_output=True, text=True, check=False, timeout=120)
        assert done.returncode == 0, done.stderr
        return list(json.loads(done.stdout)["steps"])


def check_batch(batch: dict, prompt_ids: list, completion_ids: list, tokenizer, prompts: list) -> None:
    """One stored batch against what the trainer generated: prompts, responses, groups, rewards."""
    sent = batch["trajectories"]
    assert len(sent) == len(prompt_ids)
    groups = [t["group_id"] for t in sent]
    assert groups == [i // NUM_GENERATIONS for i in range(len(sent))]  # TRL repeats each prompt in a row
    for t, p_ids, c_ids in zip(sent, prompt_ids, completion_ids):
        [turn] = t["turns"]
        generated_from = tokenizer.decode(p_ids)
        [prompt] = [p for p in prompts if (p if isinstance(p, str) else p[0]["content"]) in generated_from]
        assert turn["prompt"] == (prompt if isinstance(prompt, str) else render_plain(prompt))
        text = tokenizer.decode(c_ids, skip_special_tokens=True)
        assert turn["response"] == text
        expected = expected_reward(text)
        assert (t["reward"] is None) == (expected is None)
        if expected is not None:
            assert math.isclose(t["reward"], expected, rel_tol=1e-6)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
def test_follow_stores_every_step_of_a_conversational_run_started_before_it_and_restarted(service, run_name, tmp_path):
    _, tokenizer = tiny_policy()
    output_dir = tmp_path / "out"  # made by the trainer, after follow starts
    follower = Follower(service, run_name, output_dir, tmp_path / "spool")
    follower.start()
    first: list[int] = []

    def restart() -> None:  # files 1 and 2 are written; the follower goes down, the trainer goes on
        wait_until(lambda: len(service.batches(run_name)) == 2, 60, "steps 1 and 2 stored")
        first.extend(follower.stop())

    prompts = [[{"role": "user", "content": f"You are in room {i}. Which door leads out?"}] for i in range(8)]
    trainer = grpo(output_dir, prompts, AtStepEnd(3, restart))
    trainer.train()
    assert first == [1, 2]
    assert follower.once() == [3, 4]  # the state file kept 1 and 2 from being sent again

    batches = service.payloads(run_name)
    assert [b["step"] for b in batches] == [1, 2, 3, 4]
    for batch, (prompt_ids, completion_ids) in zip(batches, trainer.generated):
        check_batch(batch, prompt_ids, completion_ids, tokenizer, prompts)
    rewards = [t["reward"] for b in batches for t in b["trajectories"]]
    assert None in rewards  # both functions returned None: sent as a missing reward
    files = sorted((output_dir / "completions").glob("*.parquet"))
    assert [f.name for f in files] == [f"completions_0000{s}.parquet" for s in (1, 2, 3, 4)]
    state = json.loads(default_state_path(output_dir, run_name).read_text())
    assert sorted(state["files"]) == [f"completions/{f.name}" for f in files]

    # a file read by `send`, rendered with the policy's chat template: the text tokenizes to exactly
    # the ids the trainer generated from
    model_dir = tmp_path / "policy"
    tokenizer.save_pretrained(model_dir)
    templated = f"{run_name}-template"
    code = main(["send", str(files[0]), "--url", service.url, "--run", templated, "--reward-weights", "1,0.5",
                 "--chat-template-from", str(model_dir), "--spool-dir", str(tmp_path / "spool")])  # fmt: skip
    assert code == 0
    [batch] = service.payloads(templated)
    assert batch["step"] == 1
    for t, p_ids in zip(batch["trajectories"], trainer.generated[0][0]):
        assert tokenizer(t["turns"][0]["prompt"], add_special_tokens=False)["input_ids"] == p_ids
    assert [t["reward"] for t in batch["trajectories"]] == [t["reward"] for t in batches[0]["trajectories"]]
    assert main(["send", str(files[0]), "--run", run_name, "--reward-weights", "1"]) == 2
    without_pyarrow = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['pyarrow'] = None; from collapse_monitor.cli import main; "
         f"sys.exit(main(['send', {str(files[0])!r}, '--run', 'r', '--url', 'http://127.0.0.1:9']))"],
        capture_output=True, text=True, check=False, env={**os.environ, "COLLAPSE_MONITOR_SPOOL_DIR": str(tmp_path)},
    )  # fmt: skip
    assert without_pyarrow.returncode == 2
    assert "pip install 'collapse-monitor-client[parquet]'" in without_pyarrow.stderr


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning")
@pytest.mark.usefixtures("one_thread")
def test_follow_stores_each_generation_of_a_plain_text_run_once_also_when_files_repeat_it(service, run_name, tmp_path):
    """steps_per_generation=2: TRL generates at steps 1 and 3 and writes the same generation again at 2 and 4."""
    _, tokenizer = tiny_policy()
    output_dir = tmp_path / "out"
    follower = Follower(service, run_name, output_dir, tmp_path / "spool")
    state_path = default_state_path(output_dir, run_name)
    follower.start()
    first: list[int] = []

    def restart() -> None:
        wait_until(lambda: state_path.exists() and len(json.loads(state_path.read_text())["files"]) == 2, 60, "2 files")
        first.extend(follower.stop())

    prompts = [f"You are in room {i}. Which door leads out?" for i in range(8)]
    trainer = grpo(output_dir, prompts, AtStepEnd(3, restart), steps_per_generation=2)
    trainer.train()
    assert first == [1]
    assert follower.once() == [3]

    batches = service.payloads(run_name)
    assert [b["step"] for b in batches] == [1, 3]
    assert len(trainer.generated) == 2
    for batch, (prompt_ids, completion_ids) in zip(batches, trainer.generated):
        check_batch(batch, prompt_ids, completion_ids, tokenizer, prompts)  # plain prompts as they are
    state = json.loads(state_path.read_text())["files"]
    assert state["completions/completions_00002.parquet"]["same_as"] == "completions/completions_00001.parquet"
    assert state["completions/completions_00004.parquet"]["same_as"] == "completions/completions_00003.parquet"
