"""The runs overview: a page of runs with each run's status light, latest figures and sparklines."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from service.api.deps import Caller, State, next_page
from service.reads.overview import overview_page
from service.reads.runs import MAX_PAGE_RUNS
from service.schemas.reads import OverviewResponse

router = APIRouter(tags=["runs"])


@router.get("/v1/overview", responses={404: {"description": "`after` names no run"}})
def runs_overview(
    state: State,
    access: Caller,
    response: Response,
    points: Annotated[int, Query(ge=0, le=1000, description="Sparkline length in scored steps.")] = 60,
    runs: Annotated[str | None, Query(description="Comma-separated run names; all runs when absent.")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_RUNS, description="Runs per page, in creation order.")] = 100,
    after: Annotated[
        str | None, Query(max_length=200, description="The last run of the previous page (its `Link: rel=next`).")
    ] = None,
) -> OverviewResponse:
    """What the runs page shows of each run, oldest run first, a page of ``limit`` runs at a time; a full
    page links to the next one (``Link: <...>; rel="next"``)."""
    names = [n for n in runs.split(",") if n] if runs is not None else None
    access.read(names)
    if after is not None:  # a cursor is a read of its run: another team's would tell that it exists and its age
        access.read([after])
    with state.sessions() as session:
        page = overview_page(session, names, limit, after, points)
    if len(page) == limit:
        next_page(response, "/v1/overview", {"points": points, "runs": runs, "limit": limit, "after": page[-1].name})
    return OverviewResponse(runs=page)
