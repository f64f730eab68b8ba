"""Rate limits over the real app: 429 with Retry-After per client, health and metrics never limited."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_a_client_over_its_rate_gets_429_and_others_do_not(tmp_path, client_for):
    client = client_for(
        f"sqlite:///{tmp_path / 'm.db'}", scoring_paused=True, rate_limit_per_second=0.5, rate_limit_burst=2
    )
    assert [client.get("/v1/runs").status_code for _ in range(2)] == [200, 200]
    refused = client.get("/v1/runs")
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "2"
    assert refused.json()["error"] == "rate_limited"
    assert client.get("/healthz").status_code == 200
    assert client.get("/metrics").status_code == 200
    other = client.get("/v1/runs", headers={"authorization": "Bearer some-token"})
    assert other.status_code == 200  # another client: its token is its key
    assert 'collapse_monitor_rejections_total{reason="rate_limited"} 1.0' in client.get("/metrics").text


def test_a_zero_rate_turns_the_limit_off(tmp_path, client_for):
    client = client_for(f"sqlite:///{tmp_path / 'm.db'}", scoring_paused=True, rate_limit_per_second=0)
    assert {client.get("/v1/runs").status_code for _ in range(300)} == {200}
