"""``follow`` and ``send`` on files a hostile or broken trainer folder holds: each is skipped with its
path and reason, progress is saved first, and the later steps still reach the service (issue 38)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rollouts import trajectories
from running_service import RunningService

from collapse_monitor.cli import main
from collapse_monitor.follow import default_state_path

CLI = Path(sys.executable).parent / "collapse-monitor-client"


def good_step(folder: Path, step: int) -> None:
    (folder / f"{step}.jsonl").write_text(json.dumps({"step": step, "trajectories": trajectories(step)}) + "\n")


def hostile_folder(folder: Path, outside: Path) -> dict[str, str]:
    """Step files 2-8, one vector each; the reason each must be skipped with."""
    folder.mkdir()
    good_step(folder, 1)
    os.symlink("2.jsonl", folder / "2.jsonl")  # a symlink loop
    (folder / "3.jsonl").mkdir()  # a folder named like a step file
    (folder / "4.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (folder / "5.jsonl").write_bytes(b'{"step": 5, "trajectories": [], "x": "\xff"}\n')
    os.mkfifo(folder / "6.jsonl")  # opening it would block until a writer comes
    good_step(outside, 7)
    os.symlink(outside / "7.jsonl", folder / "7.jsonl")  # out of the folder
    with open(folder / "8.jsonl", "wb") as f:
        f.truncate(2 * 1024**3)  # 2 GB of NULs (sparse: costs no disk)
    time.sleep(0.02)
    good_step(folder, 9)
    return {
        "2.jsonl": "cannot be followed",
        "3.jsonl": "a folder",
        "4.jsonl": "nested too deep",
        "5.jsonl": "not UTF-8",
        "6.jsonl": "a FIFO",
        "7.jsonl": "a symlink out of",
        "8.jsonl": "a line longer than",
    }


def test_every_unreadable_step_is_skipped_with_its_reason_and_later_steps_are_delivered(
    service: RunningService, run_name: str, tmp_path: Path
) -> None:
    folder = tmp_path / "rollouts"
    reasons = hostile_folder(folder, tmp_path)
    command = [str(CLI), "follow", str(folder), "--url", service.url, "--run", run_name, "--once", "--settle", "0"]
    command += ["--spool-dir", str(tmp_path / "spool")]
    first = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["steps"] == [1, 9]
    assert [s for s, _ in service.batches(run_name)] == [1, 9]
    state = json.loads(default_state_path(folder, run_name).read_text())["files"]
    for name, reason in reasons.items():
        assert reason in state[name]["error"], (name, state[name])
        assert f"skipped {name}" in first.stderr
    # a restart passes them by: no crash loop, nothing sent twice, no error logged again
    again = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["steps"] == []
    assert "skipped" not in again.stderr
    good_step(folder, 10)
    later = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    assert json.loads(later.stdout)["steps"] == [10]
    assert [s for s, _ in service.batches(run_name)] == [1, 9, 10]


def test_send_refuses_a_fifo_a_folder_and_deep_json_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "1.jsonl")
    (tmp_path / "2.jsonl").mkdir()
    (tmp_path / "3.jsonl").write_text("[" * 100_000 + "\n")
    common = ["--url", "http://127.0.0.1:9", "--run", "r", "--spool-dir", str(tmp_path / "spool")]
    for name in ("1.jsonl", "2.jsonl"):
        assert main(["send", str(tmp_path / name), *common]) == 2
        assert "is not a regular file" in capsys.readouterr().err
    assert main(["send", str(tmp_path / "3.jsonl"), *common]) == 2
    assert "nested too deep" in capsys.readouterr().err


def test_sigterm_stops_follow_promptly_with_progress_saved(
    service: RunningService, run_name: str, tmp_path: Path
) -> None:
    folder = tmp_path / "rollouts"
    folder.mkdir()
    good_step(folder, 1)
    os.mkfifo(folder / "2.jsonl")  # a FIFO once blocked follow forever, deaf to SIGTERM
    time.sleep(0.02)
    good_step(folder, 3)
    command = [str(CLI), "follow", str(folder), "--url", service.url, "--run", run_name, "--settle", "0"]
    follower = subprocess.Popen(
        [*command, "--poll", "0.2", "--spool-dir", str(tmp_path / "spool")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    state_path = default_state_path(folder, run_name)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        state_path.exists() and "3.jsonl" in json.loads(state_path.read_text())["files"]
    ):
        time.sleep(0.1)
    follower.send_signal(signal.SIGTERM)
    started = time.monotonic()
    out, err = follower.communicate(timeout=60)
    assert time.monotonic() - started < 40  # the sender's close waits at most 30 s
    assert follower.returncode == 0, err
    assert json.loads(out)["steps"] == [1, 3]
    state = json.loads(state_path.read_text())["files"]
    assert "a FIFO" in state["2.jsonl"]["error"]
    assert [s for s, _ in service.batches(run_name)] == [1, 3]


def test_a_number_past_what_a_token_id_or_a_float_holds_makes_its_step_invalid_and_later_steps_are_delivered(
    service: RunningService, run_name: str, tmp_path: Path
) -> None:
    # 1e400 reads as an infinity, 10**400 as an int no float holds: both raised OverflowError out of follow
    folder = tmp_path / "rollouts"
    folder.mkdir()
    (folder / "1.jsonl").write_text('{"step": 1, "group_id": 0, "prompt_token_ids": [1e400], "response": "r"}\n')
    entropies = "1" + "0" * 400
    (folder / "2.jsonl").write_text(
        f'{{"step": 2, "prompt": "p", "response": "r", "token_entropies": [{entropies}]}}\n'
    )
    good_step(folder, 3)
    command = [str(CLI), "follow", str(folder), "--url", service.url, "--run", run_name, "--once", "--settle", "0"]
    command += ["--spool-dir", str(tmp_path / "spool")]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    result = json.loads(done.stdout)
    assert result["stats"]["invalid"] == 2, done.stderr
    assert "prompt_token_ids must hold integers" in done.stderr
    assert "token_entropies must hold numbers" in done.stderr
    assert [s for s, _ in service.batches(run_name)] == [3]
