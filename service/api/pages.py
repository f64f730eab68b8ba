"""The web pages: the runs list, one run, the compare view and the API's (/docs), plus their static files.

The pages are static HTML and JavaScript over the JSON API (no build step); every number they
show comes from ``/v1``. Each page's file holds only its own body: ``page.html`` (the document
shell) and ``frame.html`` (the header and the token dialog) are filled in here, not copied into
each page. They carry the user's bearer token, if given,
so they follow the API's access rules. The chart library and Swagger UI are vendored
(``service/web/vendor``): nothing comes from a CDN, and the Content-Security-Policy
(``service.api.middleware``) allows no other source. ``/static`` serves the pages' scripts and
styles only, never the package's other files.
"""

from __future__ import annotations

from pathlib import Path
from string import Template
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

import service.web

WEB = Path(service.web.__file__).parent
UPLOT_VERSION = "1.6.32"  # service/web/vendor/uplot/README.md says how to update it
SWAGGER_UI_VERSION = "5.35.0"  # service/web/vendor/swagger-ui/README.md says how to update it
STATIC_SUFFIXES = frozenset({".js", ".css"})  # what the pages load from /static
VENDOR_LICENCES = frozenset({"LICENSE", "NOTICE"})  # served beside the vendored code they cover
# The pages change with the server; revalidating each load costs a 304, a stale page costs a bug.
NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


def is_page_asset(path: str) -> bool:
    """Whether /static serves ``path``: the pages' scripts and styles, and the vendored code's licences."""
    file = Path(path)
    if file.suffix in STATIC_SUFFIXES:
        return True
    return file.parts[:1] == ("vendor",) and (file.name in VENDOR_LICENCES or file.name.endswith(".LICENSE.txt"))


class _PageAssets(StaticFiles):
    """The pages' assets (``is_page_asset``), revalidated on each load; any other file (Python sources,
    READMEs, folders) is a 404."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        if not is_page_asset(path):
            raise HTTPException(status_code=404)
        return await super().get_response(path, scope)

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(NO_CACHE)
        return response


def static_files() -> StaticFiles:
    """The pages' scripts, styles and vendored libraries, mounted at /static."""
    return _PageAssets(directory=WEB)


NAV = (("/", "Runs"), ("/compare", "Compare runs"), ("/docs", "API"))
APP_ASSETS = ("style.css", "api.js", "ui.js")
CHART_ASSETS = ("vendor/uplot/uPlot.min.css", "vendor/uplot/uPlot.iife.min.js", *APP_ASSETS, "charts.js")


def _fill(template: str, **slots: str) -> str:
    return Template((WEB / template).read_text()).substitute(slots)


def _page(title: str, body: str, assets: tuple[str, ...]) -> HTMLResponse:
    """``body`` in the document shell, loading ``assets`` (from /static; stylesheets before scripts)."""
    tags = [f'  <link rel="stylesheet" href="/static/{path}">' for path in assets if path.endswith(".css")]
    tags += [f'  <script src="/static/{path}" defer></script>' for path in assets if path.endswith(".js")]
    return HTMLResponse(_fill("page.html", title=title, assets="\n".join(tags), body=body), headers=NO_CACHE)


def _app_page(title: str, name: str, current: str, assets: tuple[str, ...], *, is_live: bool = True) -> HTMLResponse:
    """The page ``name``.html inside the header (``current`` marked in the nav) and the token dialog.

    ``is_live``: the page polls and shows its last update in the header.
    """
    nav = "".join(
        f'<a href="{href}"'
        + (' id="compare-link"' if href == "/compare" else "")
        + (' aria-current="page"' if href == current else "")
        + f">{text}</a>"
        for href, text in NAV
    )
    live = '<span id="live" class="live">loading…</span>' if is_live else '<span class="live"></span>'
    main = (WEB / f"{name}.html").read_text().rstrip("\n")
    return _page(title, _fill("frame.html", nav=nav, live=live, main=main).rstrip("\n"), assets)


@router.get("/")
def runs_page() -> HTMLResponse:
    return _app_page("Runs", "runs", "/", (*APP_ASSETS, "runs.js"))


@router.get("/runs/{run}")
def run_page(run: str) -> HTMLResponse:  # noqa: ARG001 - the page reads the run name from its own URL
    return _app_page("Run", "run", "", (*CHART_ASSETS, "run.js"))


@router.get("/compare")
def compare_page() -> HTMLResponse:
    return _app_page("Compare", "compare", "/compare", (*CHART_ASSETS, "compare.js"), is_live=False)


@router.get("/docs")
def api_page() -> HTMLResponse:
    """Swagger UI over /openapi.json, from the vendored copy (FastAPI's own loads it from a CDN)."""
    assets = ("vendor/swagger-ui/swagger-ui.css", "vendor/swagger-ui/swagger-ui-bundle.js", "docs.js")
    return _page("API", (WEB / "docs.html").read_text().rstrip("\n"), assets)
