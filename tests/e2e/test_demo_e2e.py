"""The demo feeder drives a real server end to end, and its simulated rollouts collapse as described."""

from __future__ import annotations

import pytest

from service.demo import TEMPLATES, rollouts, run_demo
from tests.e2e.conftest import service_env, start_service

pytestmark = pytest.mark.e2e


def test_the_demo_feeds_a_server_and_reports_every_step(processes, tmp_path):
    base = start_service(processes, service_env(tmp_path))
    lines: list[str] = []
    statuses = run_demo(base, run="demo-e2e", steps=6, collapse_start=3, groups=3, per_group=2, report=lines.append)
    assert [s["status"] for s in statuses] == ["done"] * 6
    assert [line.split()[1] for line in lines[:6]] == ["1", "2", "3", "4", "5", "6"]
    assert all(" MI " in line and "retrieval" in line for line in lines[:6])
    assert lines[6] in ("no alerts on demo-e2e", f"alerts on demo-e2e: {len(lines) - 7}")


def test_simulated_reasoning_turns_into_templates_and_rewards_stop_varying():
    healthy = rollouts(step=1, steps=20, collapse_start=10, groups=4, per_group=4, seed=0)
    collapsed = rollouts(step=20, steps=20, collapse_start=10, groups=4, per_group=4, seed=0)
    thoughts = [t["response"].split("<think>")[1].split("</think>")[0] for r in collapsed for t in r["turns"]]
    assert all(thought in TEMPLATES for thought in thoughts)
    assert {r["reward"] for r in collapsed} == {0.0}
    assert not any(
        t["response"].split("<think>")[1].split("</think>")[0] in TEMPLATES for r in healthy for t in r["turns"]
    )
    assert len({r["reward"] for r in healthy}) == 2
