"""The command line against a real service: send a JSONL file, follow a verl rollout-dump folder.

The verl dumps are written by verl's own ``RayPPOTrainer._write_generations``, compiled from the
installed verl source (importing the trainer module would pull in verl's whole GPU stack).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
from rollouts import trajectories

from collapse_monitor.cli import main
from collapse_monitor.follow import default_state_path
from collapse_monitor.monitor import Monitor

CLI = Path(sys.executable).parent / "collapse-monitor-client"


@pytest.fixture(scope="module")
def write_generations() -> Callable[..., None]:
    """verl's dump writer, exactly as verl ships it."""
    import verl

    source = Path(verl.__file__).parent / "trainer" / "ppo" / "ray_trainer.py"
    tree = ast.parse(source.read_text())
    [trainer] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RayPPOTrainer"]
    [function] = [n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "_write_generations"]
    function.decorator_list = []  # a @staticmethod in the class
    namespace: dict = {"os": os, "json": json, "print": functools.partial(print, file=sys.stderr)}
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(source), "exec"), namespace)
    return cast("Callable[..., None]", namespace["_write_generations"])


def verl_step(write, folder: Path, step: int, n_prompts: int = 3, n: int = 2, **extra) -> None:
    """One step of a GRPO run as verl dumps it: every prompt repeated n times, decoded text."""
    inputs = [f"system\nSolve.\nuser\nWhat is {p} + {step}?\nassistant\n" for p in range(n_prompts) for _ in range(n)]
    outputs = [f"<think>{p} plus {step}, attempt {k}</think>{p + step}" for p in range(n_prompts) for k in range(n)]
    scores = [float(k == 0) for _ in range(n_prompts) for k in range(n)]
    write(inputs, outputs, [None] * len(inputs), scores, {"acc": scores, **extra}, str(folder), step)


def test_send_posts_every_batch_of_a_file_and_prints_a_summary(service, run_name, tmp_path, capsys):
    dump = tmp_path / "batches.jsonl"
    dump.write_text("\n".join(json.dumps({"step": s, "trajectories": trajectories(s)}) for s in (1, 2, 3)) + "\n")
    code = main(["send", str(dump), "--url", service.url, "--run", run_name, "--spool-dir", str(tmp_path / "spool")])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["delivered"] is True
    assert result["steps"] == [1, 2, 3]
    assert result["stats"]["sent"] == 3
    assert [s for s, _ in service.batches(run_name)] == [1, 2, 3]

    # sending the same file again is a replay: nothing is stored twice
    assert (
        main(["send", str(dump), "--url", service.url, "--run", run_name, "--spool-dir", str(tmp_path / "spool")]) == 0
    )
    assert json.loads(capsys.readouterr().out)["stats"]["replayed"] == 3
    assert [s for s, _ in service.batches(run_name)] == [1, 2, 3]


def test_send_reads_a_verl_dump_file_as_one_grouped_batch(service, run_name, tmp_path, write_generations, capsys):
    verl_step(write_generations, tmp_path, 7, n_prompts=3, n=4)
    code = main(["send", str(tmp_path / "7.jsonl"), "--url", service.url, "--run", run_name])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["steps"] == [7]
    service.wait_until_processed(run_name, 1)
    monitor = Monitor(service.url, run_name)
    figures = {p["name"]: p["value"] for p in monitor.metrics(["num_groups", "num_trajectories", "reward_mean"])}
    assert figures == {"num_groups": 3.0, "num_trajectories": 12.0, "reward_mean": 0.25}


def test_bad_input_exits_with_2_and_one_line_naming_the_line(tmp_path, capsys):
    dump = tmp_path / "bad.jsonl"
    dump.write_text('{"step": 1, "trajectories": []}\n{"step": 2, "oops": 1}\n')
    assert main(["send", str(dump), "--run", "r"]) == 2
    assert "bad.jsonl:2: expected a batch" in capsys.readouterr().err
    assert main(["send", str(tmp_path / "missing.jsonl"), "--run", "r"]) == 2
    assert main(["send", str(dump), "--run", "bad name!"]) == 2
    assert "run must match" in capsys.readouterr().err


def test_follow_sends_each_complete_step_once_and_resumes_after_a_restart(
    service, run_name, tmp_path, write_generations
):
    dumps = tmp_path / "rollouts"
    spool = tmp_path / "spool"
    for step in (1, 2, 3):
        verl_step(write_generations, dumps, step)
    command = [str(CLI), "follow", str(dumps), "--url", service.url, "--run", run_name, "--spool-dir", str(spool)]
    first = subprocess.run([*command, "--once", "--settle", "3600"], capture_output=True, text=True, check=False)
    # the last file may still be written (a live trainer), so it waits until a later step appears
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["steps"] == [1, 2]

    verl_step(write_generations, dumps, 4)
    time.sleep(0.05)
    second = subprocess.run([*command, "--once", "--settle", "0"], capture_output=True, text=True, check=False)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["steps"] == [3, 4]  # the state file kept 1 and 2 from being sent again
    assert [s for s, _ in service.batches(run_name)] == [1, 2, 3, 4]
    state = json.loads(default_state_path(dumps, run_name).read_text())
    assert sorted(state["files"]) == ["1.jsonl", "2.jsonl", "3.jsonl", "4.jsonl"]


def test_follow_runs_until_stopped_and_sends_a_rewritten_step_again(service, run_name, tmp_path, write_generations):
    dumps = tmp_path / "rollouts"
    dumps.mkdir()
    command = [str(CLI), "follow", str(dumps), "--url", service.url, "--run", run_name, "--settle", "0.5"]
    follower = subprocess.Popen(
        [*command, "--poll", "0.2", "--spool-dir", str(tmp_path / "spool")], stdout=subprocess.PIPE
    )
    try:
        verl_step(write_generations, dumps, 1)
        verl_step(write_generations, dumps, 2)
        wait_for(lambda: len(service.batches(run_name)) == 2)
        verl_step(write_generations, dumps, 2, n=3)  # a trainer resumed from step 1 writes step 2 again
        wait_for(lambda: len(service.batches(run_name)) == 3)
    finally:
        follower.terminate()
        out, _ = follower.communicate(timeout=60)
    assert follower.returncode == 0
    assert json.loads(out)["steps"] == [1, 2, 2]
    assert [s for s, _ in service.batches(run_name)] == [1, 2, 2]


def test_verl_transfer_queue_uids_make_multi_turn_trajectories(service, run_name, tmp_path, write_generations):
    # verl's TransferQueue trainer keys rows {prompt uid}_{session}_{output index}; scores repeat per session,
    # and every session of one prompt uid starts from that prompt
    uids = ["p0_0_0", "p0_0_1", "p0_1_0", "p1_0_0"]
    prompts, responses = ["x0", "x0 turn 1", "x0", "x1"], ["a", "b", "c", "d"]
    write_generations(prompts, responses, [None] * 4, [1.0, 1.0, 0.0, 0.5], {"uid": uids}, str(tmp_path), 5)
    assert main(["send", str(tmp_path / "5.jsonl"), "--url", service.url, "--run", run_name]) == 0
    [batch] = service.payloads(run_name)
    assert batch["step"] == 5
    assert batch["trajectories"] == [
        {
            "group_id": 0,
            "reward": 1.0,
            "turns": [{"prompt": "x0", "response": "a"}, {"prompt": "x0 turn 1", "response": "b"}],
        },
        {"group_id": 0, "reward": 0.0, "turns": [{"prompt": "x0", "response": "c"}]},
        {"group_id": 1, "reward": 0.5, "turns": [{"prompt": "x1", "response": "d"}]},
    ]


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
