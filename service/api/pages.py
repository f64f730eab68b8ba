"""The web pages: the runs list, one run, the compare view and the API's (/docs), plus their static files.

The pages are static HTML and JavaScript over the JSON API (no server-side rendering, no build
step); every number they show comes from ``/v1``. They carry the user's bearer token, if given,
so they follow the API's access rules. The chart library and Swagger UI are vendored
(``service/web/vendor``): nothing comes from a CDN, and the Content-Security-Policy
(``service.api.middleware``) allows no other source. ``/static`` serves the pages' scripts and
styles only, never the package's other files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse
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


@router.get("/")
def runs_page() -> FileResponse:
    return FileResponse(WEB / "runs.html", headers=NO_CACHE)


@router.get("/runs/{run}")
def run_page(run: str) -> FileResponse:  # noqa: ARG001 - the page reads the run name from its own URL
    return FileResponse(WEB / "run.html", headers=NO_CACHE)


@router.get("/compare")
def compare_page() -> FileResponse:
    return FileResponse(WEB / "compare.html", headers=NO_CACHE)


@router.get("/docs")
def api_page() -> FileResponse:
    """Swagger UI over /openapi.json, from the vendored copy (FastAPI's own loads it from a CDN)."""
    return FileResponse(WEB / "docs.html", headers=NO_CACHE)
