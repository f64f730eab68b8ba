"""The web pages in a real headless Chromium against a real server: what a person opening them sees."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from bench.serving import issue_token
from tests.e2e.browser import Console, screenshots, wait_for_charts
from tests.e2e.conftest import Processes, service_env, start_service
from tests.fixtures import dependence_matrix, trajectories

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.e2e
STEPS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("web")
    processes = Processes(tmp)
    try:
        yield start_service(processes, service_env(tmp))
    finally:
        processes.stop_all()


def collapse(step: int) -> float:
    """Input dependence of the collapsing run: 1 nat per token until step 10, none from step 15."""
    return max(0.0, min(1.0, (15 - step) / 5))


@pytest.fixture(scope="module")
def runs(server) -> dict[str, list[dict]]:
    """Three runs made through the API: steady, collapsing (matrix ingest), and one without batches."""
    accepted: dict[str, list[dict]] = {}
    with httpx.Client(base_url=server, timeout=30) as api:
        for name, metadata in (
            ("steady", {"model": "Qwen2.5-3B", "algorithm": "GRPO", "environment": "FrozenLake"}),
            ("collapsing", {"model": "Qwen2.5-3B", "algorithm": "PPO", "environment": "Sokoban"}),
            ("waiting", {}),
        ):
            api.post("/v1/runs", json={"name": name, "metadata": metadata}).raise_for_status()
        for step in range(1, STEPS + 1):
            for name, dependence in (("steady", 1.0), ("collapsing", collapse(step))):
                response = api.post(
                    f"/v1/runs/{name}/matrices", json=dependence_matrix(step, dependence, seed=len(name))
                )
                response.raise_for_status()
                accepted.setdefault(name, []).append(response.json())
    return accepted


def open_page(browser: Browser, url: str) -> tuple[Page, Console]:
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    console = Console(page)
    page.goto(url)
    return page, console


@pytest.mark.usefixtures("runs")
def test_runs_page_lists_runs_created_through_the_api_with_their_status_lights(browser, server):
    page, console = open_page(browser, f"{server}/")
    page.wait_for_selector('#runs tr[data-run="waiting"]')
    statuses = {
        row.get_attribute("data-run"): row.get_attribute("data-status") for row in page.locator("#runs tbody tr").all()
    }
    firing = {a["run"] for a in httpx.get(f"{server}/v1/alerts", params={"state": "firing"}).json()}
    assert firing == {"collapsing"}
    assert statuses == {"collapsing": "firing", "steady": "healthy", "waiting": "waiting"}
    assert page.locator('tr[data-run="collapsing"] .light').inner_text().lower() == "firing"

    overview = {r["name"]: r for r in httpx.get(f"{server}/v1/overview").json()["runs"]}
    mi = overview["steady"]["latest"]["mi_estimate"]["value"]
    assert page.locator('tr[data-run="steady"] td[data-metric="mi_estimate"] .value').inner_text() == f"{mi:.3f}"
    assert page.locator('tr[data-run="steady"] td[data-metric="mi_estimate"] svg.spark path').count() == 1
    assert "Sokoban" in page.locator('tr[data-run="collapsing"]').inner_text()

    page.fill("#filter", "coll")
    assert [r.get_attribute("data-run") for r in page.locator("#runs tbody tr").all()] == ["collapsing"]
    page.fill("#filter", "")
    page.click('th[data-sort="name"]')
    assert [r.get_attribute("data-run") for r in page.locator("#runs tbody tr").all()] == [
        "collapsing",
        "steady",
        "waiting",
    ]
    assert console.errors == []
    page.close()


@pytest.mark.usefixtures("runs")
def test_runs_page_shows_a_page_of_runs_at_a_time_and_polls_only_the_shown_page(browser, server):
    names = [r["name"] for r in httpx.get(f"{server}/v1/overview", params={"points": 0}).json()["runs"]]
    assert len(names) >= 3
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    console = Console(page)
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/v1/overview" in r.url else None)
    page.goto(f"{server}/?limit=2")  # the page passes its limit on to the overview

    def shown() -> list[str | None]:
        return sorted(row.get_attribute("data-run") for row in page.locator("#runs tbody tr").all())

    page.wait_for_selector(f'#runs tbody tr[data-run="{names[0]}"]')
    assert shown() == sorted(names[:2])
    assert page.locator("#previous-page").is_disabled()
    page.click("#next-page")
    page.wait_for_selector(f'#runs tbody tr[data-run="{names[2]}"]')
    assert shown() == sorted(names[2:4])
    assert f"after={names[1]}" in page.url  # a reload stays on the page
    asked.clear()
    page.wait_for_event("request", lambda r: "/v1/overview" in r.url, timeout=20_000)  # the next poll (every 5 s)
    assert asked
    assert all("limit=2" in url and f"after={names[1]}" in url for url in asked), asked
    page.click("#previous-page")
    page.wait_for_selector(f'#runs tbody tr[data-run="{names[0]}"]')
    assert shown() == sorted(names[:2])
    assert console.errors == []
    page.goto(f"{server}/?limit=2&after=deleted-since")  # a link to a page whose first run is gone: the first page
    page.wait_for_selector(f'#runs tbody tr[data-run="{names[0]}"]')
    assert "after=" not in page.url
    page.close()


def drawn_points(page: Page) -> list[dict]:
    drawn: list[dict] = page.evaluate(
        """() => window.collapseMonitor.group.members.flatMap(m => m.series.map((s, i) => ({
            chart: m.chartId, name: s.name, sampler: s.sampler,
            points: m.u.data[i + 1].filter(v => v !== null).length })))"""
    )
    return drawn


def test_run_page_draws_every_stored_point_the_alert_span_and_the_heatmap(browser, server, runs):
    page, console = open_page(browser, f"{server}/runs/collapsing")
    wait_for_charts(page)
    page.wait_for_selector("svg.heatmap rect.cell")

    drawn = drawn_points(page)
    assert {"mi_estimate", "retrieval_accuracy", "retrieval_chance_level", "conditional_entropy_est"} <= {
        d["name"] for d in drawn
    }
    for series in drawn:
        stored = httpx.get(
            f"{server}/v1/runs/collapsing/metrics", params={"names": series["name"], "sampler": series["sampler"]}
        ).json()["points"]
        assert series["points"] == len(stored) == STEPS, series

    (alert,) = httpx.get(f"{server}/v1/runs/collapsing/alerts", params={"rule": "TemplateCollapse"}).json()
    spans = page.evaluate(
        """() => window.collapseMonitor.group.members.map(m => {
            const span = m.u.over.querySelector('.alert-span.pending[data-rule="TemplateCollapse"]');
            return span && {chart: m.chartId, onset: m.u.posToVal(parseFloat(span.style.left), 'x')};
        })"""
    )
    assert len(spans) == len({d["chart"] for d in drawn})
    assert all(spans), spans
    for span in spans:
        assert span["onset"] == pytest.approx(alert["onset_step"], abs=0.01), span
    assert page.locator(".alert-span.firing").count() == len(spans)
    assert page.locator(f'.alerts-table tr[data-alert-id="{alert["id"]}"]').inner_text().count("TemplateCollapse")

    newest = runs["collapsing"][-1]
    batch = httpx.get(f"{server}/v1/batches/{newest['batch_id']}").json()
    shape = batch["results"]["samplers"]["matrix"]
    assert page.locator("#step h2").inner_text().startswith(f"Step {STEPS}")
    assert page.locator("svg.heatmap rect.cell").count() == shape["rows"] * shape["columns"] == 48
    assert page.locator("table.breakdown tbody tr").count() == shape["columns"]
    assert console.errors == []
    page.close()


def brightness(fill: str | None) -> float:
    assert fill is not None
    red, green, blue = (int(v) for v in re.findall(r"\d+", fill))
    return 0.2126 * red + 0.7152 * green + 0.0722 * blue


@pytest.mark.usefixtures("runs")
def test_clicking_a_step_shows_its_heatmap_diagonal_before_collapse_and_flat_after(browser, server):
    page, console = open_page(browser, f"{server}/runs/collapsing")
    wait_for_charts(page)
    page.wait_for_selector("svg.heatmap rect.cell")
    contrast = {}
    for step in (3, 20):
        x, y = page.evaluate(
            """step => { const u = window.collapseMonitor.group.members[0].u;
                         const box = u.over.getBoundingClientRect();
                         return [box.left + u.valToPos(step, 'x'), box.top + box.height / 2]; }""",
            step,
        )
        page.mouse.click(x, y)
        page.wait_for_selector(f"#step h2:text-matches('^Step {step}\\\\b')")
        own = [brightness(c.get_attribute("fill")) for c in page.locator("svg.heatmap rect.cell.own").all()]
        other = [brightness(c.get_attribute("fill")) for c in page.locator("svg.heatmap rect.cell:not(.own)").all()]
        contrast[step] = sum(own) / len(own) - sum(other) / len(other)
    # Healthy: own prompts at p ~ 0.47 against ~ 0.18 (1 nat per token apart, 4 prompts); collapsed: 1/4 everywhere.
    assert contrast[3] > 35
    assert abs(contrast[20]) < 10
    assert console.errors == []
    page.close()


@pytest.mark.usefixtures("runs")
def test_a_batch_posted_while_the_page_is_open_appears_without_a_reload(browser, server):
    with httpx.Client(base_url=server, timeout=30) as api:
        api.post("/v1/runs", json={"name": "live"}).raise_for_status()
        for step in (1, 2, 3):
            api.post("/v1/runs/live/matrices", json=dependence_matrix(step, 1.0)).raise_for_status()
        page, console = open_page(browser, f"{server}/runs/live")
        wait_for_charts(page)
        page.evaluate("() => { window.notReloaded = true; }")
        assert {d["points"] for d in drawn_points(page) if d["name"] == "mi_estimate"} == {3}
        api.post("/v1/runs/live/matrices", json=dependence_matrix(4, 1.0)).raise_for_status()
        page.wait_for_function(
            """() => window.collapseMonitor.group.members[0].u.data[1].filter(v => v !== null).length === 4""",
            timeout=20_000,
        )
        page.wait_for_selector("#step h2:text-matches('^Step 4\\\\b')")
    assert page.evaluate("() => window.notReloaded") is True
    assert "last step 4" in page.locator("#run-progress").inner_text()
    assert console.errors == []
    page.close()


def test_the_api_page_renders_every_operation_from_the_vendored_swagger_ui_under_the_csp(browser, server):
    page, console = open_page(browser, f"{server}/docs")
    page.wait_for_selector(".opblock", timeout=30_000)
    operations = httpx.get(f"{server}/openapi.json").json()["paths"]
    assert page.locator(".opblock").count() == sum(len(methods) for methods in operations.values())
    assert page.locator(".opblock-summary-path", has_text="/v1/runs/{run}/batches").count() >= 1
    assert console.errors == []  # a CSP refusal (inline script or style, another origin) is a console error
    page.close()


@pytest.mark.usefixtures("runs")
def test_compare_overlays_one_metric_of_several_runs(browser, server):
    page, console = open_page(browser, f"{server}/compare?runs=steady,collapsing&metric=mi_estimate")
    wait_for_charts(page)
    drawn = drawn_points(page)
    assert [(d["name"], d["points"]) for d in drawn] == [("mi_estimate", STEPS), ("mi_estimate", STEPS)]
    assert page.locator("#links a").count() == 2
    assert 'collapse_monitor_mi_estimate_nats{run=~"steady|collapsing"' in page.locator("#links pre").inner_text()
    assert console.errors == []
    page.close()


@pytest.mark.usefixtures("runs")
def test_the_pages_send_the_token_the_user_gave(browser, server):
    page = browser.new_page()
    page.add_init_script("localStorage.setItem('collapse-monitor.token', 'secret-token')")
    sent: list[str | None] = []
    page.on("request", lambda r: sent.append(r.headers.get("authorization")) if "/v1/" in r.url else None)
    page.goto(f"{server}/")
    page.wait_for_selector("#runs tbody tr")
    assert sent
    assert set(sent) == {"Bearer secret-token"}
    page.close()


@pytest.mark.usefixtures("runs")
def test_screenshots_of_the_runs_page_and_a_collapsing_run(browser, server, tmp_path):
    shots = screenshots(browser, server, "collapsing", tmp_path, step=STEPS)
    assert [p.name for p in shots] == ["runs-page.png", "run-page.png"]
    for path in shots:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width == 1440
        assert height >= 600


def test_with_tokens_required_for_reads_the_page_asks_for_one_and_then_shows_the_data(browser, tmp_path):
    env = service_env(tmp_path, COLLAPSE_MONITOR_REQUIRE_TOKEN_FOR_READS="true")
    issued = {scope: issue_token(env, "--scope", scope) for scope in ("read", "ingest")}
    processes = Processes(tmp_path)
    try:
        server = start_service(processes, env)
        with httpx.Client(base_url=server, timeout=30, headers={"Authorization": f"Bearer {issued['ingest']}"}) as api:
            api.post("/v1/runs", json={"name": "secured"}).raise_for_status()
            for step in (1, 2, 3):
                api.post("/v1/runs/secured/matrices", json=dependence_matrix(step, 1.0)).raise_for_status()
        assert httpx.get(f"{server}/v1/overview").status_code == 401

        page, console = open_page(browser, f"{server}/")
        page.wait_for_selector("#token-dialog[open]")
        assert page.locator("#token-dialog .token-reason").inner_text().startswith("The server wants a token")
        page.fill("#token-dialog input", issued["read"])
        page.click("#token-dialog button[value=save]")
        page.wait_for_selector('#runs tr[data-run="secured"]')
        assert page.evaluate("() => localStorage.getItem('collapse-monitor.token')") == issued["read"]

        page.goto(f"{server}/runs/secured")  # the token stays: no question this time
        wait_for_charts(page)
        assert {d["points"] for d in drawn_points(page) if d["name"] == "mi_estimate"} == {3}
        assert page.locator("#token-dialog[open]").count() == 0
        with page.expect_download() as download:
            page.locator(".chart-links a.link", has_text="CSV").first.click()
        assert download.value.path().read_text().startswith("step,")
        # The only errors: the browser's report of the first, refused requests.
        assert [e for e in console.errors if "401" not in e] == []
        page.close()
    finally:
        processes.stop_all()


def filter_figures(step: int) -> dict[str, float]:
    """What a trainer's SNR filter sends with step ``step``'s batch: engaged from step 3 on, keeping half the groups."""
    engaged = step >= 3
    return {
        "rollout/filter_engaged": float(engaged),
        "rollout/filter_kept_ratio": 0.5 if engaged else 1.0,
        "rollout/filter_kept_count": 2.0 if engaged else 4.0,
        "rollout/filter_kept_rows": 6.0 if engaged else 12.0,
        "rollout/chosen_in_group_reward_std": 0.6,
        **({"rollout/dropped_in_group_reward_std": 0.1} if engaged else {}),
    }


def test_the_run_page_draws_the_trainers_snr_filter_and_the_policys_own_entropy_apart_from_the_scorers(browser, server):
    def drawn_of(page: Page, chart: str) -> dict[tuple[str, str], int]:
        return {(d["sampler"], d["name"]): d["points"] for d in drawn_points(page) if d["chart"] == chart}

    with httpx.Client(base_url=server, timeout=30) as api:
        api.post("/v1/runs", json={"name": "filtered", "schedule": {"every": 1000}}).raise_for_status()

        def send(step: int) -> None:
            body = {"step": step, "trajectories": trajectories(), "figures": filter_figures(step)}
            api.post("/v1/runs/filtered/batches", json=body).raise_for_status()

        def log(step: int) -> None:  # what the trainer logged after the step: the policy's own entropy
            api.post("/v1/runs/filtered/figures", json={"step": step, "figures": {"actor/entropy": 2.0 - step / 10}})

        for step in (1, 2, 3, 4):
            send(step)
            log(step)
        deadline = time.monotonic() + 60  # step 1 is scored (the schedule's first step), the others done at ingest
        while api.get("/v1/runs/filtered").json()["batches"] != {"done": 4} and time.monotonic() < deadline:
            time.sleep(0.1)
        page, console = open_page(browser, f"{server}/runs/filtered")
        wait_for_charts(page)
        page.wait_for_function(
            "() => window.collapseMonitor.group.members.some(m => m.chartId === 'snr-filter')", timeout=20_000
        )
        assert drawn_of(page, "snr-filter") == {
            ("trainer", "rollout/filter_kept_ratio"): 4,
            ("trainer", "rollout/filter_engaged"): 4,
            ("all", "rollout/filter_kept_ratio"): 4,  # the run's filter's advice, beside what the trainer kept
            ("trainer", "rollout/chosen_in_group_reward_std"): 4,
            ("trainer", "rollout/dropped_in_group_reward_std"): 2,
        }
        assert drawn_of(page, "token-entropy")[("trainer", "actor/entropy")] == 4
        labels = page.evaluate(
            """() => window.collapseMonitor.group.members.find(m => m.chartId === 'token-entropy')
                .u.series.slice(1).map(s => s.label)"""
        )
        assert labels[0] == "policy entropy (trainer)"
        assert "reference scorer, matched pairs" in labels
        # A figure the trainer logs after the page has drawn its step's batch still appears: step 5's batch is
        # drawn, then its entropy arrives, then step 6's batch.
        send(5)
        page.wait_for_function(
            """() => window.collapseMonitor.group.members.find(m => m.chartId === 'snr-filter')
                .u.data[1].filter(v => v !== null).length === 5""",
            timeout=20_000,
        )
        log(5)
        send(6)
        page.wait_for_function(
            """() => window.collapseMonitor.group.members.find(m => m.chartId === 'token-entropy')
                .u.data[1].filter(v => v !== null).length === 5""",
            timeout=20_000,
        )
    assert console.errors == []
    page.close()
