"""Every series a web page draws is one the service stores, on SQLite and Postgres (issue 18).

The names are read from the pages' own source, the stored series from a run scored through the
API with everything a trainer can send (text, rewards, token entropies): a page asking for a name
the service never writes would draw an empty chart without any error.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.fixtures import trajectories, wait_for

pytestmark = pytest.mark.integration

WEB = Path(__file__).resolve().parents[2] / "service" / "web"
# A series object of run.js's CHARTS ({ name: "...", sampler: ALL, ... }; its arrays hold no braces), and an
# estimate drawn with its 95% interval (withInterval: the name and its _ci_high/_ci_low bounds).
SERIES = re.compile(r'\{\s*name: "([^"]+)"([^{}]*)\}')
WITH_INTERVAL = re.compile(r'withInterval\(\s*"([^"]+)"')
# What the runs page reads of each run's latest figures, and the compare page's default metric.
LATEST = re.compile(r'latest\(r, "([^"]+)"\)')
COMPARE_DEFAULT = re.compile(r'metric: query\.get\("metric"\) \|\| "([^"]+)"')


def run_page_series() -> set[tuple[str, str | None]]:
    """(name, sampler) of every series run.js draws: batch-level ones under "all", the trainer's own under
    "trainer", the rest (None) under the sampler the page's switch shows."""
    source = (WEB / "run.js").read_text()
    drawn = {
        (name, "all" if "sampler: ALL" in rest else "trainer" if "sampler: TRAINER" in rest else None)
        for name, rest in SERIES.findall(source)
    }
    for name in WITH_INTERVAL.findall(source):
        drawn |= {(name, None), (f"{name}_ci_high", None), (f"{name}_ci_low", None)}
    return drawn


def test_the_patterns_read_every_series_of_the_run_page():
    # A rewritten chart table the patterns miss must fail here, not leave the test below checking nothing.
    source = (WEB / "run.js").read_text()
    assert len(SERIES.findall(source)) == source.count('name: "')
    assert {
        ("mi_estimate_ci_high", None),
        ("rollout/in_group_reward_std", "all"),
        ("actor/entropy", "trainer"),
        ("rollout/filter_kept_ratio", "trainer"),
        ("rollout/filter_kept_ratio", "all"),
    } <= run_page_series()


def test_every_series_the_pages_draw_is_stored_for_a_scored_run(database_url, client_for):
    client = client_for(database_url)
    assert client.post("/v1/runs", json={"name": "drawn"}).status_code == 201
    sent = trajectories()
    for trajectory in sent:
        for turn in trajectory["turns"]:
            turn["token_entropies"] = [0.5, 1.5]
    # What a trainer with the SNR filter sends with its batch (the client's snr_filter.FIGURE_NAMES) and after it.
    figures = {
        "rollout/filter_engaged": 1.0,
        "rollout/filter_kept_ratio": 0.75,
        "rollout/filter_kept_count": 3.0,
        "rollout/filter_kept_rows": 9.0,
        "rollout/chosen_in_group_reward_std": 0.5,
        "rollout/dropped_in_group_reward_std": 0.0,
        "rollout/filter_skipped": 0.0,
    }
    accepted = client.post("/v1/runs/drawn/batches", json={"step": 1, "trajectories": sent, "figures": figures})
    assert accepted.status_code == 202, accepted.text
    logged = client.post("/v1/runs/drawn/figures", json={"step": 1, "figures": {"actor/entropy": 1.25}})
    assert logged.status_code == 201, logged.text
    assert wait_for(client, accepted.json()["batch_id"])["status"] == "done"

    (overview,) = client.get("/v1/overview", params={"runs": "drawn"}).json()["runs"]
    sampler = overview["sampler"]  # the page's sampler switch starts on it
    series = client.get("/v1/runs/drawn/metrics", params={"format": "columns"}).json()["series"]
    stored = {(s["sampler"], s["name"]) for s in series if s["values"]}

    missing = sorted(name for name, drawn_from in run_page_series() if (drawn_from or sampler, name) not in stored)
    assert missing == [], f"run.js draws series the service does not store: {missing}"

    latest = set(LATEST.findall((WEB / "runs.js").read_text()))
    assert latest
    assert latest <= set(overview["latest"]), f"runs.js reads latest figures the overview lacks: {latest}"
    (default,) = COMPARE_DEFAULT.findall((WEB / "compare.js").read_text())
    assert (sampler, default) in stored
