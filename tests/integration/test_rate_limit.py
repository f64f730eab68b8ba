"""Rate limits over the real app: 429 with Retry-After per client, health and metrics never limited."""

from __future__ import annotations

import pytest

from service.access import issue_token

pytestmark = pytest.mark.integration


def test_a_client_over_its_rate_gets_429_and_others_do_not(tmp_path, client_for):
    client = client_for(
        f"sqlite:///{tmp_path / 'm.db'}", scoring_paused=True, rate_limit_per_second=0.5, rate_limit_burst=2
    )
    assert [client.get("/v1/runs").status_code for _ in range(2)] == [200, 200]
    refused = client.get("/v1/runs")
    assert refused.status_code == 429
    # a token comes back in 2 s at 0.5/s, less the time the requests took (over 1 s on a loaded machine)
    assert refused.headers["retry-after"] in ("1", "2")
    assert refused.json()["error"] == "rate_limited"
    assert client.get("/healthz").status_code == 200
    assert client.get("/metrics").status_code == 200
    made_up = client.get("/v1/runs", headers={"authorization": "Bearer some-token"})
    assert made_up.status_code == 429  # a token this service never issued buys no bucket of its own
    assert 'collapse_monitor_rejections_total{reason="rate_limited"} 2.0' in client.get("/metrics").text


def test_a_zero_rate_turns_the_limit_off(tmp_path, client_for):
    client = client_for(f"sqlite:///{tmp_path / 'm.db'}", scoring_paused=True, rate_limit_per_second=0)
    assert {client.get("/v1/runs").status_code for _ in range(300)} == {200}


def test_each_issued_token_is_a_client_of_its_own(tmp_path, client_for):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    client = client_for(
        url, scoring_paused=True, rate_limit_per_second=0.5, rate_limit_burst=2, require_token_for_reads=True
    )
    with client.app.state.monitor.sessions.begin() as session:
        first, second = (issue_token(session, "read").secret for _ in range(2))
    # A token's first request is charged to its address, until the service has looked the token up.
    assert client.get("/v1/runs", headers={"authorization": f"Bearer {first}"}).status_code == 200
    assert [client.get("/v1/runs", headers={"authorization": f"Bearer {first}"}).status_code for _ in range(3)] == [
        200,
        200,
        429,
    ]
    assert client.get("/v1/runs", headers={"authorization": f"Bearer {second}"}).status_code == 200
    assert client.get("/v1/runs", headers={"authorization": f"Bearer {second}"}).status_code == 200
    assert client.get("/v1/runs").status_code == 429  # the address spent its burst on the two first requests


def test_every_path_is_limited_but_probes_and_scrapes_have_room_of_their_own(tmp_path, client_for):
    client = client_for(
        f"sqlite:///{tmp_path / 'm.db'}", scoring_paused=True, rate_limit_per_second=0.5, rate_limit_burst=3
    )
    assert [client.get(p).status_code for p in ("/nope", "/", "/static/style.css")] == [404, 200, 200]
    for path in ("/nope", "/", "/static/style.css", "/v1/runs", "/docs"):
        assert client.get(path).status_code == 429, path
    assert {client.get(p).status_code for p in ("/healthz", "/readyz") for _ in range(20)} == {200}
    assert [client.get("/metrics").status_code for _ in range(4)] == [200, 200, 200, 429]  # its own bucket


def test_made_up_methods_count_as_other_and_add_no_series(tmp_path, client_for):
    """Issue 17: 500 requests with made-up methods grew /metrics from 13 KB to 108 KB (the method was a label)."""
    client = client_for(f"sqlite:///{tmp_path / 'm.db'}", scoring_paused=True, rate_limit_per_second=0)
    client.request("X00000", "/nope")
    before = client.get("/metrics").text
    for i in range(1, 501):
        assert client.request(f"X{i:05d}", "/nope").status_code == 404
    after = client.get("/metrics").text
    assert "X00" not in after
    assert 'collapse_monitor_requests_total{method="OTHER",route="unmatched",status="404"} 501.0' in after
    assert len(after) < len(before) + 200  # the same series, larger counts
