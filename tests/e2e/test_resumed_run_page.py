"""A resumed run's page in a real Chromium, on SQLite and on Postgres: its charts draw the current segment.

A run whose steps went back once (matrices of steps 1-6, then step 3 again with other values) once drew
no chart at all while its header said "live · updated" (issue 29, row 3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.browser import Console, wait_for_charts
from tests.e2e.conftest import service_env, start_service
from tests.fixtures import dependence_matrix

if TYPE_CHECKING:
    pass

pytestmark = pytest.mark.e2e


@pytest.fixture
def resumed(database_url, tmp_path, processes) -> str:
    """A server (on each database) holding run ``resumed``: steps 1-6, then step 3 again, other values."""
    base = start_service(processes, service_env(tmp_path, database_url))
    with httpx.Client(base_url=base, timeout=30) as api:
        api.post("/v1/runs", json={"name": "resumed"}).raise_for_status()
        for step in range(1, 7):
            body = dependence_matrix(step, 1.0) | {"batch_id": f"first-{step}"}
            api.post("/v1/runs/resumed/matrices", json=body).raise_for_status()
        again = api.post("/v1/runs/resumed/matrices", json=dependence_matrix(3, 0.2, seed=1) | {"batch_id": "again-3"})
        again.raise_for_status()
        assert (again.json()["segment"], again.json()["resumed"]) == (1, True)
    return base


def test_a_resumed_runs_page_draws_the_current_segments_points(browser, resumed):
    current = httpx.get(f"{resumed}/v1/runs/resumed/metrics", params={"names": "mi_estimate", "sampler": "matrix"})
    assert [(p["step"], p["segment"]) for p in current.json()["points"]] == [(1, 0), (2, 0), (3, 1)]
    everything = httpx.get(
        f"{resumed}/v1/runs/resumed/metrics", params={"names": "mi_estimate", "sampler": "matrix", "segments": "all"}
    ).json()["points"]
    (replaced,) = [p["value"] for p in everything if (p["step"], p["segment"]) == (3, 0)]
    assert current.json()["points"][-1]["value"] != pytest.approx(replaced)  # the resume's own step 3 is drawn

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    console = Console(page)
    page.goto(f"{resumed}/runs/resumed")
    wait_for_charts(page)
    drawn: list[dict] = page.evaluate(
        """() => window.collapseMonitor.group.members.flatMap(m => m.series.map((s, i) => {
            const ys = m.u.data[i + 1];
            const points = Array.from(m.u.data[0]).flatMap((x, j) => ys[j] == null ? [] : [[x, ys[j]]]);
            return {name: s.name, sampler: s.sampler, points};
        }))"""
    )
    assert {"mi_estimate", "retrieval_accuracy", "conditional_entropy_est"} <= {d["name"] for d in drawn}
    (mi,) = [d["points"] for d in drawn if (d["name"], d["sampler"]) == ("mi_estimate", "matrix")]
    assert mi == [[p["step"], pytest.approx(p["value"])] for p in current.json()["points"]]
    for series in drawn:  # every chart draws steps 1-3 and nothing of the replaced steps 4-6
        assert series["points"], series
        assert {x for x, _ in series["points"]} <= {1, 2, 3}, series
    assert console.errors == []
    page.close()
