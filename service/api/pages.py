"""The web pages: the runs list, one run, and the compare view, plus their static files.

The pages are static HTML and JavaScript over the JSON API (no server-side rendering, no build
step); every number they show comes from ``/v1``. They carry the user's bearer token, if given,
so they follow the API's access rules. The chart library is vendored (``service/web/vendor``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles

import service.web

WEB = Path(service.web.__file__).parent
UPLOT_VERSION = "1.6.32"  # service/web/vendor/uplot/README.md says how to update it
# The pages change with the server; revalidating each load costs a 304, a stale page costs a bug.
NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


class _Revalidated(StaticFiles):
    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(NO_CACHE)
        return response


def static_files() -> StaticFiles:
    """The pages' scripts, styles and vendored libraries, mounted at /static."""
    return _Revalidated(directory=WEB)


@router.get("/")
def runs_page() -> FileResponse:
    return FileResponse(WEB / "runs.html", headers=NO_CACHE)


@router.get("/runs/{run}")
def run_page(run: str) -> FileResponse:  # noqa: ARG001 - the page reads the run name from its own URL
    return FileResponse(WEB / "run.html", headers=NO_CACHE)


@router.get("/compare")
def compare_page() -> FileResponse:
    return FileResponse(WEB / "compare.html", headers=NO_CACHE)
