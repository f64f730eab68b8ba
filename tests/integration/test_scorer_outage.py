"""A scorer whose server hangs, against a real worker and database: its run's batch waits with the
scorer's error, another run on the same worker is scored meanwhile (the breaker's probes hold no batch),
and the stuck batch fails with the scorer's last error after scorer_outage_seconds."""

from __future__ import annotations

import time

import pytest
import transformers

from tests.fixtures import trajectories, wait_for
from tests.misbehaving_vllm import misbehaving_server

pytestmark = pytest.mark.integration

# Generous bounds: scorer_outage_seconds (5) after the first try's 1 s deadline, a busy machine.
OUTAGE_SECONDS = 5.0
FAILS_WITHIN_SECONDS = 120.0


def test_a_hanging_scorer_holds_only_its_own_run_and_its_batch_fails_with_the_scorers_error(database_url, client_for):
    # Imported whole first: the worker's first load of a vLLM scorer's tokenizer, in a thread of its own, otherwise
    # raced transformers' lazy imports here ("cannot import name 'AutoTokenizer'"), a failure unrelated to the outage.
    assert transformers.AutoTokenizer is not None
    with misbehaving_server("hang") as server:
        stuck = f"vllm+http://127.0.0.1:{server.server_address[1]}?model=m&tokenizer=tiny-random"
        client = client_for(
            database_url,
            scorers={"tiny-random": "tiny-random", "stuck": stuck},
            vllm_timeout_seconds=1.0,
            vllm_retries=0,
            max_attempts=1,  # not what ends an outage: scorer_outage_seconds is
            scorer_outage_seconds=OUTAGE_SECONDS,
        )
        for name, scorer in (("stuck-run", "stuck"), ("ok-run", "tiny-random")):
            response = client.post("/v1/runs", json={"name": name, "scorer": scorer, "sampler": {"num_samples": 4}})
            assert response.status_code == 201, response.json()
        body = {"step": 1, "trajectories": trajectories()}
        stuck_id = client.post("/v1/runs/stuck-run/batches", json=body).json()["batch_id"]
        start = time.monotonic()
        ok_ids = [
            client.post("/v1/runs/ok-run/batches", json={"step": s, "trajectories": trajectories()}).json()["batch_id"]
            for s in (1, 2, 3)
        ]
        assert [wait_for(client, b)["status"] for b in ok_ids] == ["done"] * 3
        waiting = client.get(f"/v1/batches/{stuck_id}").json()
        failed = wait_for(client, stuck_id, timeout=FAILS_WITHIN_SECONDS)
        assert time.monotonic() - start < FAILS_WITHIN_SECONDS
    if waiting["status"] != "failed":  # the API said why it waited
        assert "did not answer GET /v1/models" in (waiting["error"] or ""), waiting
    assert failed["status"] == "failed"
    assert failed["error"].startswith("scorer 'stuck' has not answered for ")
    assert "(scorer_outage_seconds=5); giving up. Its last error: scorer 'stuck'" in failed["error"]
    assert "did not answer" in failed["error"]
    assert "GET /v1/models" in failed["error"]
    assert "ReadTimeout" in failed["error"]
    assert time.monotonic() - start >= OUTAGE_SECONDS
