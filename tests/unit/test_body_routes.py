"""Body parsing as the body routes do it: FastAPI's own refusals, shared numbers, and routes that must check access."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from service.api.bodies import (
    BODY_SIZES,
    MAX_LISTED_ERRORS,
    MAX_SHARED_INTS,
    BodyValidationError,
    parse_body,
    shared_ints,
)
from service.api.deps import AccessFirst, WritesRun
from service.errors import InvalidRequest, TooLarge
from service.ingest.limits import IngestLimits
from service.schemas.inputs import BatchIn, FilterRequest, RunCreate
from service.settings import Settings

LIMITS = IngestLimits.of(Settings(_env_file=None))


class Ids(BaseModel):
    ids: list[int]


def test_numbers_are_shared_by_value_and_the_values_are_json_s():
    body = json.dumps({"ids": [70_000, 70_000, 123_456, 70_000, -5, 0]}).encode()
    parsed = parse_body(body, Ids, LIMITS)
    assert parsed.ids == json.loads(body)["ids"]
    assert parsed.ids[0] is parsed.ids[1] is parsed.ids[3]  # one int object per distinct number


def test_at_most_max_shared_ints_are_kept():
    parse = shared_ints()
    values = [parse(str(n)) for n in range(MAX_SHARED_INTS + 10)]
    assert values == list(range(MAX_SHARED_INTS + 10))
    assert parse("300") is values[300]  # kept: the same object
    assert parse(str(MAX_SHARED_INTS + 5)) is not values[MAX_SHARED_INTS + 5]  # past the cap: parsed anew


def test_refusals_are_fastapis_own_under_body():
    with pytest.raises(RequestValidationError) as invalid_json:
        parse_body(b'{"step": 1,', BatchIn, LIMITS)
    assert invalid_json.value.errors() == [
        {
            "type": "json_invalid",
            "loc": ("body", 11),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": "Expecting property name enclosed in double quotes"},
        }
    ]
    with pytest.raises(RequestValidationError) as invalid:
        parse_body(b'{"step": -1, "trajectories": []}', BatchIn, LIMITS)
    assert [e["loc"] for e in invalid.value.errors()] == [("body", "step"), ("body", "trajectories")]
    with pytest.raises(HTTPException, match="There was an error parsing the body"):
        parse_body(b"[" * 10_000, BatchIn, LIMITS)  # past Python's recursion limit (past 65,536: 413 too_large)
    with pytest.raises(InvalidRequest, match="byte order mark"):
        parse_body(b"\xef\xbb\xbf{}", BatchIn, LIMITS)
    with pytest.raises(InvalidRequest, match="byte 9 is not UTF-8"):
        parse_body(b'{"step": \xff}', BatchIn, LIMITS)


def test_a_body_route_without_an_access_check_is_refused_when_declared():
    router = APIRouter(route_class=AccessFirst)
    with pytest.raises(TypeError, match="a route with a body must declare its access check"):

        @router.post("/v1/runs/{run}/things")
        def unguarded(run: str, body: Ids) -> None:  # pragma: no cover - never registered
            pass

    @router.post("/v1/runs/{run}/things", dependencies=[WritesRun])
    def guarded(run: str, body: Ids) -> None:  # pragma: no cover - only declared
        pass

    @router.get("/v1/runs/{run}/things")
    def no_body(run: str) -> None:  # pragma: no cover - only declared
        pass


def test_a_list_over_its_limit_is_refused_413_before_validation():
    body = b'{"step": 1, "trajectories": [' + b",".join([b"{}"] * 333_333) + b"]}"
    with pytest.raises(TooLarge, match="a batch may hold at most 4096 trajectories, got 333333"):
        parse_body(body, BatchIn, LIMITS)
    rewards = json.dumps({"rewards": [[1.0]] * 10_001}).encode()
    with pytest.raises(TooLarge, match=r"at most 10000 groups \(max_filter_groups\), got 10001"):
        parse_body(rewards, FilterRequest, LIMITS)


def test_the_limits_a_body_is_checked_against_are_the_configured_ones():
    limits = IngestLimits.of(Settings(_env_file=None, max_trajectories=3, max_matrix_rows=2, max_reasoning_tokens=0))
    assert (limits.max_trajectories, limits.max_matrix_rows, limits.reasoning_window) == (3, 2, None)
    # BODY_SIZES names its limits as strings: each must be a field of the slice (read with getattr).
    assert {size.limit for sizes in BODY_SIZES.values() for size in sizes} <= {f.name for f in fields(IngestLimits)}
    with pytest.raises(TooLarge, match="a batch may hold at most 3 trajectories, got 4"):
        parse_body(b'{"step": 1, "trajectories": [{}, {}, {}, {}]}', BatchIn, limits)


def test_a_422_lists_the_first_errors_and_counts_them_all():
    body = b'{"step": 1, "trajectories": [' + b",".join([b"{}"] * 4096) + b"]}"
    with pytest.raises(BodyValidationError) as invalid:
        parse_body(body, BatchIn, LIMITS)
    assert len(invalid.value.errors()) == MAX_LISTED_ERRORS
    # Trajectories are validated one at a time up to the 20th error: group_id, reward and turns missing from the
    # first 7 (21 errors), the other 4,089 never looked at.
    assert invalid.value.n_errors == 3 * 7
    assert invalid.value.errors()[0]["loc"] == ("body", "trajectories", 0, "group_id")
    assert invalid.value.errors()[-1]["loc"] == ("body", "trajectories", 6, "reward")
    unknown = json.dumps({"name": "r"} | {f"k{i}": 0 for i in range(255)}).encode()  # past 256 keys: a 413 first
    with pytest.raises(BodyValidationError) as extra:
        parse_body(unknown, RunCreate, LIMITS)
    assert extra.value.n_errors == 255
    assert [e["loc"] for e in extra.value.errors()] == [("body", f"k{i}") for i in range(MAX_LISTED_ERRORS)]
