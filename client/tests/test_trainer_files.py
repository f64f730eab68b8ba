"""``follow`` and ``send`` on the files verl V1, prime-rl, AReaL, ROLL and slime write (trainer_writers.py).

Each run starts ``collapse-monitor-client follow DIR`` before the trainer has made ``DIR``, stops it
after two steps, lets the trainer write two more, and starts it again: every step must reach the
service once, with its groups, rewards and turns.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_writers import AReaL, PrimeRl, Roll, Slime, VerlV1, canonical, wait_for

from collapse_monitor.cli import main
from collapse_monitor.follow import default_state_path
from collapse_monitor.formats import detect

CLI = Path(sys.executable).parent / "collapse-monitor-client"
OPTIONS = {"slime": ["--trust-pickle", "--reward-key", "acc"]}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    """The policy's tokenizer saved as a model folder (slime's --hf-checkpoint)."""
    from scoring.models import build_tiny_random

    _, tok = build_tiny_random(seed=3)
    folder: Path = tmp_path_factory.mktemp("policy")
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(policy_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy_dir)


def writer(name: str, folder: Path, tokenizer):
    return {
        "verl": lambda: VerlV1(folder),
        "prime-rl": lambda: PrimeRl(folder),
        "areal": lambda: AReaL(folder, tokenizer),
        "roll": lambda: Roll(folder, tokenizer),
        "slime": lambda: Slime(folder, tokenizer),
    }[name]()


def follow_command(service, run: str, folder: Path, spool: Path, name: str, policy_dir: Path) -> list[str]:
    options = OPTIONS.get(name, [])
    if name == "slime":
        options = [*options, "--tokenizer", str(policy_dir)]
    return [str(CLI), "follow", str(folder), "--url", service.url, "--run", run, "--spool-dir", str(spool), *options]


@pytest.mark.parametrize("name", ["verl", "prime-rl", "areal", "roll", "slime"])
def test_follow_started_before_the_trainer_and_restarted_stores_every_step_once(
    service, run_name, tmp_path, tokenizer, policy_dir, name
):
    folder = tmp_path / "out"  # made by the trainer, after follow starts
    trainer = writer(name, folder, tokenizer)
    command = follow_command(service, run_name, folder, tmp_path / "spool", name, policy_dir)
    follower = subprocess.Popen([*command, "--poll", "0.2", "--settle", "0.5"], stdout=subprocess.PIPE, text=True)
    try:
        trainer.write_step(1)
        trainer.write_step(2)
        wait_for(lambda: len(service.batches(run_name)) == 2, what="steps 1 and 2 stored")
    finally:
        follower.terminate()
        out, _ = follower.communicate(timeout=60)
    assert follower.returncode == 0
    assert json.loads(out)["steps"] == [1, 2]

    trainer.write_step(3)
    trainer.write_step(4)
    again = subprocess.run([*command, "--once", "--settle", "0"], capture_output=True, text=True, check=False)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["steps"] == [3, 4]  # the state file kept 1 and 2 from being sent again

    batches = service.payloads(run_name)
    assert [b["step"] for b in batches] == [1, 2, 3, 4]
    for batch in batches:
        assert canonical(batch["trajectories"]) == trainer.expected(batch["step"]), batch["step"]
    state = json.loads(default_state_path(folder, run_name).read_text())
    assert state["format"] == name
    assert all("error" not in record for record in state["files"].values())


def test_each_layout_is_detected_from_the_folder_and_evaluation_is_left_out(tmp_path, tokenizer):
    for name in ("verl", "prime-rl", "areal", "roll", "slime"):
        folder = tmp_path / name
        assert detect(folder) is None  # not there yet
        trainer = writer(name, folder, tokenizer)
        trainer.write_step(2)
        assert detect(folder) == name
    # prime-rl's output_dir holds metrics.jsonl beside rollouts/: still prime-rl, not a verl dump
    (tmp_path / "prime-rl" / "metrics.jsonl").write_text('{"step": 2, "loss": 0.1}\n')
    assert detect(tmp_path / "prime-rl") == "prime-rl"
    # DIR may also be the folder the steps sit in
    assert detect(tmp_path / "prime-rl" / "rollouts") == "prime-rl"
    assert detect(tmp_path / "areal" / "rollout") == "areal"
    assert detect(tmp_path / "slime" / "rollout_data") == "slime"


def test_prime_rl_all_traces_and_evaluation_are_read_when_asked(service, run_name, tmp_path):
    trainer = PrimeRl(tmp_path)
    trainer.write_step(2)
    common = ["--url", service.url, "--spool-dir", str(tmp_path / "spool"), "--once", "--settle", "0"]
    assert main(["follow", str(tmp_path), "--run", run_name, "--traces", "train/all", *common]) == 0
    assert main(["follow", str(tmp_path), "--run", f"{run_name}-eval", "--traces", "eval/effective", *common]) == 0
    [every] = service.payloads(run_name)
    assert len(every["trajectories"]) == 7  # the 6 shipped episodes and the one left out of the cohort
    [evaluation] = service.payloads(f"{run_name}-eval")
    assert evaluation["step"] == 2
    assert [t["turns"][-1]["reasoning"] for t in evaluation["trajectories"]] == ["9 plus 2, try 0"]


def test_areal_versions_wait_until_their_stragglers_have_landed(tmp_path, tokenizer):
    from collapse_monitor.follow import Follower
    from collapse_monitor.monitor import Monitor

    trainer = AReaL(tmp_path, tokenizer)
    trainer.write_step(1)
    trainer.write_step(2)  # version 2 has begun: version 1 may still gain a straggler
    monitor = Monitor("http://127.0.0.1:9", "areal-wait", enabled=False)
    follower = Follower(tmp_path, monitor, tmp_path / "state.json", settle_seconds=60)
    assert follower.pending() == []  # nothing has rested a minute
    assert [u.key for u in follower.pending(now=9e9)] == ["rollout/1", "rollout/2"]


def test_slime_dumps_are_read_only_when_the_folder_is_trusted(
    service, run_name, tmp_path, tokenizer, policy_dir, capsys
):
    trainer = Slime(tmp_path, tokenizer)
    trainer.write_step(1)
    dump = tmp_path / "rollout_data" / "1.pt"
    common = ["--url", service.url, "--run", run_name, "--spool-dir", str(tmp_path / "spool")]
    assert main(["send", str(dump), *common]) == 2
    assert "pass --trust-pickle if you trust the folder" in capsys.readouterr().err
    assert main(["follow", str(tmp_path), "--once", "--settle", "0", *common]) == 2
    assert "pass --trust-pickle" in capsys.readouterr().err
    assert service.payloads(run_name) == []
    # trusted, but multi-turn samples need the policy's tokenizer, and dict rewards their key
    assert main(["send", str(dump), "--trust-pickle", *common]) == 2
    assert "policy's tokenizer" in capsys.readouterr().err
    tok = ["--tokenizer", str(policy_dir)]
    assert main(["send", str(dump), "--trust-pickle", *tok, *common]) == 2
    assert "name the key to read (reward_key)" in capsys.readouterr().err
    assert main(["send", str(dump), "--trust-pickle", "--reward-key", "acc", *tok, *common]) == 0
    [batch] = service.payloads(run_name)
    assert (batch["step"], canonical(batch["trajectories"])) == (1, trainer.expected(1))


def test_send_reads_each_trainers_file_with_the_step_its_place_names(service, run_name, tmp_path, tokenizer):
    files = {}
    for name in ("verl", "prime-rl", "areal", "roll"):
        trainer = writer(name, tmp_path / name, tokenizer)
        trainer.write_step(5)
        files[name] = (
            trainer,
            sorted(p for p in (tmp_path / name).rglob("*.jsonl") if "train/all" not in p.as_posix()),
        )
    # AReaL's task files are named by task id, its version folder names the step; one task file is one group
    trainer, [first, *_] = files["areal"]
    assert first.parent.name == "5"
    assert first.stem != "5"
    for name, (trainer, paths) in files.items():
        run = f"{run_name}-{name}"
        path = paths[0] if name != "prime-rl" else next(p for p in paths if "train/effective" in p.as_posix())
        assert main(["send", str(path), "--url", service.url, "--run", run, "--spool-dir", str(tmp_path / "s")]) == 0
        [batch] = service.payloads(run)
        assert batch["step"] == 5, name
        if name != "areal":
            assert canonical(batch["trajectories"]) == trainer.expected(5), name


def test_follow_writes_the_stop_file_and_runs_the_command_when_the_alert_fires(service, run_name, tmp_path):
    from alert_matrices import ALERTS, post_matrices

    folder, stop_file, ran = tmp_path / "out", tmp_path / "STOP", tmp_path / "ran.txt"
    command = [
        str(CLI), "follow", str(folder), "--url", service.url, "--run", run_name, "--spool-dir", str(tmp_path / "s"),
        "--settings", json.dumps({"alerts": ALERTS}), "--poll", "0.2", "--settle", "0.2", "--alert-poll", "0.2",
        "--stop-file", str(stop_file),
        "--on-alert", f'echo -n "$COLLAPSE_MONITOR_RULE $COLLAPSE_MONITOR_STATE $COLLAPSE_MONITOR_STEP" > {ran}',
    ]  # fmt: skip
    follower = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        VerlV1(folder).write_step(1)
        wait_for(lambda: len(service.batches(run_name)) == 1, what="step 1 stored")
        post_matrices(service.url, run_name, {1: False, 2: True})
        time.sleep(1.0)  # pending is not a stop state: nothing happens
        assert not stop_file.exists()
        post_matrices(service.url, run_name, {3: True})
        wait_for(lambda: ran.exists() and stop_file.exists(), what="the alert acted on")
    finally:
        follower.terminate()
        follower.communicate(timeout=60)
    assert follower.returncode == 0
    assert stop_file.read_text().startswith("TemplateCollapse on sampler")
    assert "firing at step 3" in stop_file.read_text()
    assert ran.read_text() == "TemplateCollapse firing 3"


def test_files_that_do_not_hold_what_the_trainer_writes_are_named_with_their_field(tmp_path, capsys):
    roll = tmp_path / "rollout_dump_data.step_3.jsonl"
    roll.write_text(json.dumps({"id": ["a", "b"], "prompt": ["x"], "responses": ["r1", "r2"], "scores": [1, 0]}) + "\n")
    assert main(["send", str(roll), "--run", "r", "--url", "http://127.0.0.1:9", "--spool-dir", str(tmp_path)]) == 2
    assert "ROLL column prompt must be a list of 2 values, got 1" in capsys.readouterr().err

    episode = tmp_path / "rollouts" / "step_4" / "train" / "effective" / "traces.jsonl"
    episode.parent.mkdir(parents=True)
    record = {"task": {"key": "t"}, "group": {"id": "g"}, "traces": [{"nodes": [
        {"parent": 1, "message": {"role": "user", "content": "q"}},
        {"parent": 0, "message": {"role": "assistant", "content": "a"}, "sampled": True},
    ]}]}  # fmt: skip
    episode.write_text(json.dumps(record) + "\n")
    assert main(["send", str(episode), "--run", "r", "--url", "http://127.0.0.1:9", "--spool-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "traces.jsonl:1: not a verifiers episode record as prime-rl writes it" in err
    assert "or the graph has a cycle" in err

    areal = tmp_path / "rollout" / "2" / "7.jsonl"
    areal.parent.mkdir(parents=True)
    areal.write_text(
        json.dumps({"task_id": [7], "sample_idx": 0, "prompt": "p", "completion": "c", "reward": 1}) + "\n"
    )
    assert main(["send", str(areal), "--run", "r", "--url", "http://127.0.0.1:9", "--spool-dir", str(tmp_path)]) == 2
    assert "7.jsonl:1: task_id must be an integer or a string, got [7]" in capsys.readouterr().err
