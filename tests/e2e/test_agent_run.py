"""Multi-turn agent RL, live: a real GRPO loop (bench/real_run/agent.py, the tiny random policy) sends its
episodes through the client as multi-turn trajectories; the service scores each turn index apart (the
per_turn sampler), exports it to Prometheus, and the run page draws one line per turn.

The real runs (SmolLM2-135M, hours) are in docs/evaluation.md; this keeps the loop and the wiring honest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.browser import Console, wait_for_charts
from tests.e2e.conftest import service_env, start_service

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.fixture
def agent_run(tmp_path, processes) -> tuple[str, Path]:
    """A service, and the agent loop's run on it trained and scored: (base URL, the loop's folder)."""
    base = start_service(processes, service_env(tmp_path))
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLAPSE_MONITOR_")}
    out = tmp_path / "agent"
    command = [sys.executable, "-m", "bench.real_run.agent", "--arm", "rooms-lr-s0", "--smoke", "--url", base]
    command += ["--out", str(out), "--steps", str(STEPS), "--prompts", "4", "--generations", "2"]
    command += ["--max-new-tokens", "6"]
    done = subprocess.run(
        command, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    deadline = time.monotonic() + 900  # 3 steps of 3 samplers on one CPU worker; a busy machine takes minutes
    while time.monotonic() < deadline:  # close() delivered every step; scoring follows on the worker
        batches = httpx.get(f"{base}/v1/runs/agent-rooms-lr-s0").json()["batches"]
        if batches.get("done") == STEPS:
            break
        time.sleep(1)
    assert batches == {"done": STEPS}
    return base, out


def test_a_multi_turn_run_is_scored_per_turn_exported_and_drawn_one_line_a_turn(browser, agent_run):
    base, out = agent_run
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    # The tiny policy never finds the object: every episode plays all four turns.
    n_turns = max(len(e["turns"]) for s in steps for e in s["episodes"])
    assert n_turns == 4
    turns = [f"turn_{k}" for k in range(1, n_turns + 1)]

    overview = httpx.get(f"{base}/v1/overview", params={"runs": "agent-rooms-lr-s0"}).json()["runs"][0]
    assert {"first_turn", "trajectory", *turns} <= set(overview["samplers"])
    for sampler in turns:
        points = httpx.get(
            f"{base}/v1/runs/agent-rooms-lr-s0/metrics",
            params={"names": "mi_estimate,retrieval_chance_corrected,distinct_prompts", "sampler": sampler},
        ).json()["points"]
        assert {p["step"] for p in points} == set(range(1, STEPS + 1)), sampler
        # Turn 1: the 4 starts. Later the histories part (two episodes replying alike would share one).
        prompts = {p["value"] for p in points if p["name"] == "distinct_prompts"}
        assert prompts == {4.0} if sampler == "turn_1" else min(prompts) > 4, (sampler, prompts)
    exposition = httpx.get(f"{base}/metrics").text
    for sampler in turns:
        assert f'collapse_monitor_mi_estimate_nats{{run="agent-rooms-lr-s0",sampler="{sampler}"}}' in exposition
    # No alert rule reads the per-turn breakdown.
    alerts = httpx.get(f"{base}/v1/runs/agent-rooms-lr-s0/alerts").json()
    assert all(a["sampler"] not in turns for a in alerts)

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    console = Console(page)
    page.goto(f"{base}/runs/agent-rooms-lr-s0")
    wait_for_charts(page)
    drawn: list[dict] = page.evaluate(
        """() => window.collapseMonitor.group.members.map(m => ({
            chart: m.chartId, series: m.series.map((s, i) => ({sampler: s.sampler,
            points: Array.from(m.u.data[i + 1]).filter(v => v != null).length}))}))"""
    )
    by_chart = {d["chart"]: d["series"] for d in drawn}
    for chart in ("turn-retrieval", "turn-mi"):
        assert [s["sampler"] for s in by_chart[chart]] == turns, chart
        assert all(s["points"] == STEPS for s in by_chart[chart]), chart
    assert console.errors == []
    page.close()
