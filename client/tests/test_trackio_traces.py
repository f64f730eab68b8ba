"""``follow``/``send`` on a Trackio project written by trackio itself, as verl and TRL write rollout traces.

The writers (``trackio_writers.py``) run verl 0.9.1's ``verl/utils/rollout_trace.py`` and TRL's
``trl/experimental/async_grpo/async_grpo_trainer.py`` ``log_rollout_traces`` unchanged, in processes
of their own (a second process is a trainer restarted), against the real service.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from collapse_monitor.follow import default_state_path

pytest.importorskip("trackio")

CLI = Path(sys.executable).parent / "collapse-monitor-client"
WRITER = Path(__file__).parent / "trackio_writers.py"


def env(trackio_dir: Path) -> dict[str, str]:
    return {**os.environ, "TRACKIO_DIR": str(trackio_dir), "TRL_EXPERIMENTAL_SILENCE": "1"}


def write(trainer: str, trackio_dir: Path, project: str, *steps: int) -> None:
    command = [sys.executable, str(WRITER), trainer, project, *map(str, steps)]
    done = subprocess.run(command, env=env(trackio_dir), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def client(trackio_dir: Path, *args: str) -> tuple[dict, str]:
    done = subprocess.run(
        [str(CLI), *args], env=env(trackio_dir), capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), done.stderr


def groups(payload: dict) -> list[tuple[str, float | None, str, str]]:
    return sorted(
        (str(t["group_id"]), t["reward"], t["turns"][0]["prompt"], t["turns"][0]["response"])
        for t in payload["trajectories"]
    )


def test_follow_reads_verl_traces_each_step_once_across_a_restart(service, run_name, tmp_path):
    trackio_dir = tmp_path / "trackio"
    write("verl", trackio_dir, "verl-proj", 1, 2, 3)
    common = ["--url", service.url, "--run", run_name, "--spool-dir", str(tmp_path / "spool"), "--once"]
    first, _ = client(trackio_dir, "follow", "verl-proj", "--format", "trackio", *common, "--settle", "3600")
    assert first["steps"] == [1, 2]  # step 3 may still be growing: it waits for a later step

    write("verl", trackio_dir, "verl-proj", 4)  # the trainer restarted
    database = trackio_dir / "verl-proj.db"
    # given the project's file this time: the format is found from it
    second, _ = client(trackio_dir, "follow", str(database), *common, "--settle", "0")
    assert second["steps"] == [3, 4]
    assert [s for s, _ in service.batches(run_name)] == [1, 2, 3, 4]
    payload = service.payloads(run_name)[2]
    # verl's validation pass at step 3 is not training: 3 prompts x 2 rollouts, sample_index the group,
    # the prompt as its token ids decode (token2text)
    assert groups(payload) == sorted(
        [
            (str(p), float(k == 0), f"What is {p} + 3?", f"{p} plus 3, attempt {k}: {p + 3 + k}")
            for p in range(3)
            for k in range(2)
        ]
    )
    state = json.loads(default_state_path(database, run_name).read_text())
    assert state["format"] == "trackio"
    assert sorted(state["files"]) == [f"verl-run/{s}" for s in (1, 2, 3, 4)]


def test_send_reads_trl_traces_and_names_a_row_it_cannot_read(service, run_name, tmp_path):
    trackio_dir = tmp_path / "trackio"
    write("trl", trackio_dir, "trl-proj", 8, 16)
    database = trackio_dir / "trl-proj.db"
    with sqlite3.connect(database) as db:  # a row another writer left half-written
        db.execute(
            "INSERT INTO traces (id, run_id, timestamp, run_name, step, key, messages, metadata, search_text) "
            "SELECT 'broken-row', run_id, timestamp, run_name, step, key, '[{', metadata, '' FROM traces LIMIT 1"
        )
    result, stderr = client(trackio_dir, "send", str(database), "--url", service.url, "--run", run_name)
    assert result["steps"] == [8, 16]
    assert "broken-row" in stderr
    payload = service.payloads(run_name)[0]
    # TRL: the messages are the prompt then the completion; group_id and reward from the metadata
    assert groups(payload) == sorted(
        [
            (str(p), float(k == 0), f"user: What is {p} + 8?\nassistant:", f"{p} plus 8, attempt {k}: {p + 8 + k}")
            for p in range(3)
            for k in range(2)
        ]
    )
