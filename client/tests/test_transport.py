"""What each answer of the service means for a request, and how long to wait before retrying."""

from __future__ import annotations

import email.utils

import httpx
import pytest

from collapse_monitor.sender import backoff_delay
from collapse_monitor.transport import classify, retry_after_seconds


def answer(status: int, json: object = None, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, json=json, headers=headers, request=httpx.Request("POST", "http://svc/v1/runs/r/x"))


@pytest.mark.parametrize("status", [200, 201, 202])
def test_success(status):
    assert classify(answer(status, {"batch_id": "b"})).kind == "ok"


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503, 504])
def test_transient_answers_are_retried(status):
    assert classify(answer(status, {"error": "queue_full", "detail": "later"})).kind == "retry"


@pytest.mark.parametrize("status", [400, 409, 413, 422])
def test_refusals_name_the_reason(status):
    outcome = classify(answer(status, {"error": "batch_id_conflict", "detail": "used for different content"}))
    assert outcome.kind == "refused"
    assert outcome.detail == f"{status}: batch_id_conflict: used for different content"


def test_schema_errors_list_every_field():
    body = {
        "error": "validation",
        "detail": [{"field": "trajectories[0].reward", "msg": "bad"}, {"loc": ["x"], "msg": "y"}],
    }
    assert classify(answer(422, body)).detail == "422: trajectories[0].reward: bad; ['x']: y"


def test_an_unknown_run_asks_for_the_run_to_be_created_again():
    outcome = classify(answer(404, {"error": "not_found", "detail": "run 'r' does not exist", "field": "run"}))
    assert outcome.kind == "run_missing"
    assert classify(answer(404, {"error": "not_found", "field": "batch_id"})).kind == "refused"


def test_retry_after_is_read_in_seconds_or_as_an_http_date():
    assert classify(answer(503, {}, {"Retry-After": "5"})).retry_after == 5.0
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert retry_after_seconds(httpx.Headers({"Retry-After": date}), now=1_000_000) == pytest.approx(30.0)
    assert retry_after_seconds(httpx.Headers({"Retry-After": "soon"})) is None
    assert retry_after_seconds(httpx.Headers({})) is None


def test_backoff_doubles_up_to_its_cap_with_jitter_in_the_upper_half():
    for failures, full in [(1, 0.5), (2, 1.0), (3, 2.0), (10, 30.0), (50, 30.0)]:
        delays = [backoff_delay(failures, 0.5, 30.0) for _ in range(200)]
        assert all(full / 2 <= d <= full for d in delays)
        assert max(delays) - min(delays) > full / 10  # jittered, not lockstep


@pytest.mark.parametrize(
    ("status", "error"), [(401, "unauthorized"), (401, "revoked_token"), (403, "insufficient_scope")]
)
def test_a_refused_token_is_told_apart_from_a_refused_request(status, error):
    outcome = classify(answer(status, {"error": error, "detail": "the token", "field": None, "index": None}))
    assert outcome.kind == "unauthorized"
    assert outcome.detail == f"{status}: {error}: the token"
