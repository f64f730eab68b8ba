"""The trainer's own reasoning log-probs through the real service: the gap to the scorer's on matched pairs,
over the tokens the reasoning window kept, stored, exported and answered with the matrix; bad ones are 422s."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.storage.tables import Batch
from tests.fixtures import row_count, wait_for

pytestmark = pytest.mark.integration

WINDOW = 4  # max_reasoning_tokens: the scorer scores each reasoning's first 4 of its 8 tokens


def token_trajectories(with_logprobs: bool, n_groups: int = 3, per_group: int = 2) -> list[dict]:
    """Token-id turns of 8 reasoning tokens; the trainer's log-probs are 0 on the first WINDOW tokens, and
    -50 after them, where a gap computed over unscored tokens would show."""
    out = []
    for g in range(n_groups):
        for k in range(per_group):
            turn: dict = {
                "prompt_token_ids": [10 + g, 20, 30 + g],
                "reasoning_token_ids": [40 + g + k + t for t in range(8)],
            }
            if with_logprobs:
                turn["reasoning_logprobs"] = [0.0] * WINDOW + [-50.0] * (8 - WINDOW)
            out.append({"group_id": g, "reward": float(k), "turns": [turn]})
    return out


def test_the_gap_is_measured_on_the_scored_tokens_of_matched_pairs_stored_exported_and_shown(database_url, client_for):
    client = client_for(database_url, max_reasoning_tokens=WINDOW)
    client.post("/v1/runs", json={"name": "r", "sampler": {"num_samples": 64, "samplers": ["first_turn"]}})
    first = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": token_trajectories(True)})
    assert first.status_code == 202, first.json()
    status = wait_for(client, first.json()["batch_id"])
    assert status["status"] == "done", status
    result = status["results"]["samplers"]["first_turn"]
    window = result["window"]
    assert (result["rows"], window["truncated_reasoning_ratio"], window["max_reasoning_tokens"]) == (6, 1.0, WINDOW)
    metrics = result["metrics"]
    # The trainer says log p = 0 for every scored token and rows are equally long, so the gap per token is
    # minus the mean matched log-prob per token: H(Z|X). The -50s past the window are not compared.
    assert metrics["trainer_scorer_logprob_gap"] == pytest.approx(metrics["conditional_entropy_est"], rel=1e-9)
    assert 0 < metrics["trainer_scorer_logprob_gap"] < 20

    matrix = client.get("/v1/runs/r/matrix", params={"sampler": "first_turn"}).json()
    assert matrix["metrics"]["trainer_scorer_logprob_gap"] == metrics["trainer_scorer_logprob_gap"]
    diagonal = [row[column] for row, column in zip(matrix["L_tok"], matrix["row_columns"], strict=True)]
    assert metrics["trainer_scorer_logprob_gap"] == pytest.approx(-sum(diagonal) / len(diagonal), rel=1e-5)

    # A step whose turns send no log-probs stores no gap.
    second = client.post("/v1/runs/r/batches", json={"step": 2, "trajectories": token_trajectories(False)})
    assert wait_for(client, second.json()["batch_id"])["status"] == "done"
    points = client.get(
        "/v1/runs/r/metrics", params={"names": "trainer_scorer_logprob_gap", "sampler": "first_turn"}
    ).json()["points"]
    assert [p["step"] for p in points] == [1]
    assert points[0]["value"] == pytest.approx(metrics["trainer_scorer_logprob_gap"])

    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    [sample] = families["collapse_monitor_trainer_scorer_logprob_gap_nats"].samples
    assert sample.labels == {"run": "r", "sampler": "first_turn"}
    assert sample.value == pytest.approx(metrics["trainer_scorer_logprob_gap"])


@pytest.mark.parametrize(
    ("mutate", "field", "message"),
    [
        (
            lambda turn: turn["reasoning_logprobs"].pop(),
            "trajectories[1].turns[0].reasoning_logprobs",
            "Value error, must hold one log-probability per reasoning token (8 in reasoning_token_ids), got 7",
        ),
        (
            lambda turn: turn["reasoning_logprobs"].__setitem__(5, 0.5),
            "trajectories[1].turns[0].reasoning_logprobs[5]",
            "Input should be less than or equal to 0",
        ),
        (
            lambda turn: turn.update(reasoning="a b c", reasoning_token_ids=None),
            "trajectories[1].turns[0].reasoning_logprobs",
            "Value error, needs reasoning_token_ids: the trainer's log-probs are of its own tokens, and text is "
            "tokenized by the scorer; send the turn as token ids or leave reasoning_logprobs out",
        ),
    ],
)
def test_bad_trainer_log_probs_are_a_422_naming_the_field_and_write_no_batch(
    database_url, client_for, mutate, field, message
):
    client = client_for(database_url, scoring_paused=True)
    client.post("/v1/runs", json={"name": "r"})
    trajectories = token_trajectories(True)
    mutate(trajectories[1]["turns"][0])
    response = client.post("/v1/runs/r/batches", json={"step": 1, "trajectories": trajectories})
    assert response.status_code == 422
    assert [(d["field"], d["msg"]) for d in response.json()["detail"]] == [(field, message)]
    assert row_count(database_url, Batch) == 0
