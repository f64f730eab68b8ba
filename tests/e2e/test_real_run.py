"""bench/real_run in its smoke mode: real GRPOTrainer processes feed a real service, so the script cannot rot.

The smoke mode trains the tiny random Llama (the service's ``tiny-random`` scorer's weights) for a
few steps per arm; the real run (SmolLM2-135M, ~45 min) is in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.real_run import tasks

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_the_smoke_run_trains_both_arms_and_every_scheduled_step_is_scored_by_both_scorers(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLAPSE_MONITOR_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.real_run", "--smoke", "--out", str(tmp_path), "--work", str(tmp_path / "work")],
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        process.terminate()  # on SIGTERM the script stops its trainers and its service
        stdout, stderr = process.communicate()
        pytest.fail(f"the smoke run took over 600 s:\n{stdout[-2000:]}{stderr[-3000:]}")
    assert process.returncode == 0, stdout[-2000:] + stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["arms"]) == {"healthy", "collapsing"}
    options = results["options"]
    for arm, data in results["arms"].items():
        steps = data["steps"]
        assert [s["step"] for s in steps] == list(range(1, options["steps"] + 1)), arm
        for s in steps:
            # the recorder saw exactly what TRL scored: its mean equals TRL's logged reward
            assert math.isclose(s["reward_mean"], s["trl"]["reward"], rel_tol=1e-5, abs_tol=1e-7), (arm, s["step"])
            for name in (
                "task_success",
                "opening_share",
                "slot_template_share",
                "cross_prompt_overlap",
                "mentions_operands",
            ):
                assert 0 <= s[name] <= 1, (arm, name)
            for mode, every in (("reference", options["every"]), ("policy", options["policy_every"])):
                scheduled = s["step"] == 1 or s["step"] % every == 0
                assert s["scored"][mode] == scheduled
                # every step carries the reward figures; scheduled ones the cross-scoring diagnostics too
                assert "rollout/in_group_reward_std" in s[mode], (arm, mode, s["step"])
                assert ("mi_estimate" in s[mode]) == scheduled, (arm, mode, s["step"])
        for mode in ("reference", "policy"):
            assert data["runs"][mode]["batches"] == {"done": len(steps)}, (arm, mode)
            assert isinstance(data["runs"][mode]["alerts"], list)
        # step 1 is scored by the untrained weights in both modes; later scheduled steps by the
        # LoRA checkpoint saved just before them in policy mode, so the figures part
        first, later = steps[0], [s for s in steps[1:] if "mi_estimate" in s["policy"]]
        assert first["policy"]["conditional_entropy_est"] == first["reference"]["conditional_entropy_est"]
        assert later
        assert all(
            s["policy"]["conditional_entropy_est"] != s["reference"]["conditional_entropy_est"] for s in later
        ), arm
        checkpoints = sorted(p.name for p in (tmp_path / "work" / "arms" / arm / "checkpoints").glob("checkpoint-*"))
        assert checkpoints == sorted(f"checkpoint-{s['step'] - 1}" for s in later), arm


def test_the_text_measures_see_a_shared_opening_and_cross_prompt_overlap():
    questions = ["q1", "q1", "q2", "q2"]
    varied = ["23 plus 45 is 68.", "Adding them: 68", "We subtract 9 from 40: 31", "40 - 9 = 31"]
    templated = ["To solve this we think step by step. 68"] * 2 + ["To solve this we think step by step. 31"] * 2
    assert tasks.opening_share(varied)[0] == 0.25
    assert tasks.opening_share(templated) == (1.0, "to solve this we think")
    slots = ["To calculate 23 + 45, add", "To calculate 40 + 9, then", "Sure"]
    assert tasks.opening_share(slots)[0] == 1 / 3
    assert tasks.opening_share(slots, mask_numbers=True) == (2 / 3, "to calculate # + #")
    assert tasks.cross_prompt_overlap(varied, questions) < 0.1 < tasks.cross_prompt_overlap(templated, questions)
    # the consensus reward pays for resembling the other prompts' completions, never reading the task
    rewards = tasks.consensus_rewards(templated[:1] + varied[1:], questions)
    assert rewards[0] == 0.0
    assert tasks.consensus_rewards(templated, questions)[0] > 0.5


def test_correctness_is_graded_and_reads_the_final_number():
    assert tasks.correctness("so 23 + 45 = 68", 68) == 1.0
    assert tasks.correctness("the answer is 1,250", 1250) == 1.0
    assert 0 < tasks.correctness("I get 70", 68) < 1
    assert tasks.correctness("no idea", 68) == 0.0
    assert tasks.is_correct("68, not 70", 68) is False
