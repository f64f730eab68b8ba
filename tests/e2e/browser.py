"""Headless Chromium for the web-page tests and the screenshots: Debian's chromium driven by Playwright.

Never ``playwright install``: the browser is the system package (scripts/test installs it).
``python -m tests.e2e.browser --url URL --run RUN --out DIR`` takes the README's screenshots of a
running server (scripts/screenshots does it on the demo).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = os.environ.get("COLLAPSE_MONITOR_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_missing() -> str | None:
    """Why the browser cannot start here, or None."""
    if shutil.which(CHROMIUM) is None and not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is not installed (scripts/test installs Debian's chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (scripts/test installs it)"
    return None


@contextmanager
def launched() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


class Console:
    """Collects a page's console errors and uncaught exceptions."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))


def wait_for_charts(page: Any) -> None:
    page.wait_for_function(
        "() => window.collapseMonitor && window.collapseMonitor.group && window.collapseMonitor.group.members.length"
    )


def screenshots(browser: Any, base_url: str, run: str, out: Path, step: int | None = None) -> list[Path]:
    """The runs page and one run's page (its step ``step`` picked, else the newest) as PNG files."""
    out.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
    try:
        page.goto(f"{base_url}/")
        page.wait_for_selector("#runs tbody tr")
        runs_png = out / "runs-page.png"
        page.screenshot(path=str(runs_png), full_page=True)
        page.goto(f"{base_url}/runs/{run}")
        wait_for_charts(page)
        page.wait_for_selector("svg.heatmap rect.cell")
        if step is not None:
            page.evaluate("step => window.collapseMonitor.pickStep(step)", step)
            page.wait_for_selector(f"#step h2:text-matches('^Step {step}\\\\b')")
        time.sleep(0.3)  # let uPlot finish its frame
        run_png = out / "run-page.png"
        page.screenshot(path=str(run_png), full_page=True)
        return [runs_png, run_png]
    finally:
        page.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step", type=int, default=None, help="the step whose heatmap is shown (default: newest)")
    args = parser.parse_args()
    missing = chromium_missing()
    if missing:
        raise SystemExit(missing)
    with launched() as browser:
        for path in screenshots(browser, args.url.rstrip("/"), args.run, args.out, args.step):
            print(path)  # noqa: T201 - the command's output


if __name__ == "__main__":
    main()
