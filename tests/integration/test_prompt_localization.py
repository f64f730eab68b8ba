"""Which prompts lost input dependence: named per batch and in the TemplateCollapse alert; the
matrices endpoint's token entropies and rewards."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.integration

GROUPS = [5, 7, 11, 13]
PER_GROUP = 4


def matrix(step: int, lost: tuple[int, ...] = ()) -> dict:
    """Rows of a lost group score alike under every prompt; the others 1.5 nats/token better under their own."""
    rng = np.random.default_rng(step)
    own = np.repeat(np.arange(len(GROUPS)), PER_GROUP)
    dependence = np.array([0.0 if GROUPS[j] in lost else 1.5 for j in own])[:, None]
    per_token = -2.0 - dependence * (np.arange(len(GROUPS))[None, :] != own[:, None])
    per_token = per_token + rng.normal(0, 0.1, per_token.shape)
    lengths = rng.integers(10, 20, len(own))
    return {
        "step": step,
        "row_group_ids": [GROUPS[j] for j in own],
        "reasoning_lengths": lengths.tolist(),
        "L_seq": (per_token * lengths[:, None]).tolist(),
        "token_entropy": [[2.0] * int(n) for n in lengths],
        "rewards": [0.0 if GROUPS[j] in lost else float(r % 2) for r, j in enumerate(own)],
    }


def test_a_partial_collapse_is_named_in_the_batch_and_in_the_alert(database_url, client_for):
    client = client_for(database_url, scoring_paused=True)
    client.post("/v1/runs", json={"name": "partial"})
    answers = [client.post("/v1/runs/partial/matrices", json=matrix(s)).json() for s in range(1, 9)]
    assert all(a["results"]["samplers"]["matrix"]["lost_group_ids"] == [] for a in answers)
    for step in range(9, 15):
        answer = client.post("/v1/runs/partial/matrices", json=matrix(step, lost=(7, 13)))
        assert answer.status_code == 201, answer.text
    batch = client.get(f"/v1/batches/{answer.json()['batch_id']}").json()
    result = batch["results"]["samplers"]["matrix"]
    assert result["lost_group_ids"] == [7, 13]
    flags = {p["group_id"]: p["lost_input_dependence"] for p in result["per_prompt"]}
    assert flags == {5: False, 7: True, 11: False, 13: True}
    assert result["metrics"]["token_entropy_mean"] == pytest.approx(2.0)
    # Rewards: the lost groups' rewards no longer vary.
    assert batch["results"]["rewards"]["group_ids"] == GROUPS
    stds = dict(zip(GROUPS, batch["results"]["rewards"]["group_reward_std"], strict=True))
    assert stds[7] == stds[13] == 0.0
    assert stds[5] > 0
    (alert,) = client.get("/v1/runs/partial/alerts", params={"rule": "TemplateCollapse"}).json()
    assert alert["state"] == "firing"
    assert 9 <= alert["fired_step"] <= 14
    assert alert["summary"].endswith("prompts (group ids) of the latest batch that lost input dependence: 7, 13")
    series = client.get("/v1/runs/partial/metrics", params={"names": "mi_estimate_se,zero_variance_group_ratio"})
    names = {(p["sampler"], p["name"]) for p in series.json()["points"]}
    assert names == {("matrix", "mi_estimate_se"), ("all", "zero_variance_group_ratio")}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda m: m | {"rewards": m["rewards"][:-1]}, "rewards"),
        (lambda m: m | {"token_entropy": m["token_entropy"][:-1]}, "token_entropy"),
        (lambda m: m | {"token_entropy": [[2.0], *m["token_entropy"][1:]]}, "token_entropy[0]"),
    ],
)
def test_token_entropies_and_rewards_must_match_the_rows(database_url, client_for, change, field):
    client = client_for(database_url, scoring_paused=True)
    client.post("/v1/runs", json={"name": "bad"})
    response = client.post("/v1/runs/bad/matrices", json=change(matrix(1)))
    assert response.status_code == 400  # InvalidRequest, as for the matrix's other shape errors
    assert response.json()["field"] == field
