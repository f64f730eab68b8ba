"""The demo feeder drives a real server end to end, and its simulated rollouts collapse as described."""

from __future__ import annotations

import httpx
import pytest

from service.cli.demo import TEMPLATES, rollouts, run_demo
from tests.e2e.conftest import service_env, start_service

pytestmark = pytest.mark.e2e


def test_the_demo_feeds_a_server_and_reports_every_step(processes, tmp_path):
    base = start_service(processes, service_env(tmp_path))
    lines: list[str] = []
    statuses = run_demo(base, run="demo-e2e", steps=6, collapse_start=3, groups=3, per_group=2, report=lines.append)
    assert [s.status for s in statuses] == ["done"] * 6
    assert [line.split()[1] for line in lines[:6]] == ["1", "2", "3", "4", "5", "6"]
    for line, status in zip(lines[:6], statuses, strict=True):
        assert status.results is not None
        assert status.results.samplers is not None
        mi = status.results.samplers["first_turn"].metrics["mi_estimate"]
        assert f" MI {mi:6.3f} nats " in line
    # The closing report lists exactly the alerts the API holds.
    alerts = httpx.get(f"{base}/v1/runs/demo-e2e/alerts").json()
    expected = [f"alerts on demo-e2e: {len(alerts)}"] if alerts else ["no alerts on demo-e2e"]
    assert lines[6:] == expected + [f"  [{a['state']}] {a['summary']}" for a in alerts]


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
