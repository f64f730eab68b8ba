"""Plain-completion models and missing rewards, end to end through the API on SQLite and Postgres.

A GRPO run of a model that writes no think tags (SmolLM2 in the issue: 0 of 96 completions, a
third cut by the length limit) must get metrics under ``auto``, a clear warning and a NoReasoning
alert under ``think_tags``, and never a batch called scored that scored nothing.
"""

from __future__ import annotations

import pytest

from tests.fixtures import wait_for

pytestmark = pytest.mark.integration


# plain_batch's two prompts are too few for TemplateCollapse to see a collapse early: every scored one says so.
TWO_PROMPTS = (
    "the trajectories carrying reasoning come from 2 prompts (group_id); TemplateCollapse sees a collapse before it "
    "is near-total only with 4 or more a step (docs/alerts.md, Enough rows to see)"
)


def plain_batch(step: int, rewards: list[float | None] | None = None) -> dict:
    """Two prompts, three completions each, no think tags; one completion cut inside a think block."""
    responses = ["The door on the left.", "Left, then up.", "<think>First I check the", "Up.", "Go up twice.", "Up!"]
    return {
        "step": step,
        "idempotency_key": f"plain-{step}",
        "trajectories": [
            {
                "group_id": i // 3,
                "reward": float(i % 2) if rewards is None else rewards[i],
                "turns": [{"prompt": f"<|im_start|>user\nRoom {i // 3}: which way out?<|im_end|>\n", "response": r}],
            }
            for i, r in enumerate(responses)
        ],
    }


def test_auto_scores_plain_completions_as_whole_responses(database_url, client_for):
    client = client_for(database_url)
    run = client.post("/v1/runs", json={"name": "grpo-plain", "sampler": {"num_samples": None}})
    assert run.json()["reasoning_extraction"] == "auto"
    accepted = client.post("/v1/runs/grpo-plain/batches", json=plain_batch(1))
    assert accepted.status_code == 202
    assert accepted.json()["warnings"] == [TWO_PROMPTS]
    results = wait_for(client, accepted.json()["batch_id"])["results"]
    assert results["scored"] is True
    assert "skipped_reason" not in results
    assert results["reasoning"] == {
        "extraction": "auto",
        "turns": 6,
        "think_tags": 0,
        "whole_response": 6,  # group 0's cut think block is read as a whole response too: one X per group
        "as_sent": 0,
        "truncated_think": 1,
        "with_reasoning": 6,
    }
    assert results["samplers"]["first_turn"]["rows"] == 6
    assert results["figures"]["truncated_think_ratio"] == pytest.approx(1 / 6)
    assert results["figures"]["whole_response_turn_ratio"] == 1.0
    # a trainer re-posting its run without the field still matches it
    assert client.post("/v1/runs", json={"name": "grpo-plain", "sampler": {"num_samples": None}}).status_code == 200


def test_think_tags_warn_at_ingest_never_call_the_batch_scored_and_raise_no_reasoning(database_url, client_for):
    client = client_for(database_url)
    client.post("/v1/runs", json={"name": "ragen-style", "reasoning_extraction": "think_tags", "alerts": {"window": 3}})
    batch_ids = []
    for step in (1, 2, 3):
        accepted = client.post("/v1/runs/ragen-style/batches", json=plain_batch(step))
        assert accepted.status_code == 202
        assert accepted.json()["warnings"] == [
            "no turn carries reasoning to score under reasoning_extraction=think_tags: 0 of 6 turns; 1 think blocks "
            "were opened and never closed; the batch will not be cross-scored (send reasoning or set the run's "
            "reasoning_extraction to auto or whole_response)"
        ]
        batch_ids.append(accepted.json()["batch_id"])
    for batch_id in batch_ids:
        results = wait_for(client, batch_id)["results"]
        assert results["scored"] is False
        assert results["skipped_reason"] == "no turn carries reasoning to score"
        assert results["reasoning"]["with_reasoning"] == 0
    [alert] = client.get("/v1/runs/ragen-style/alerts").json()
    assert (alert["rule"], alert["severity"], alert["state"], alert["fired_step"]) == (
        "NoReasoning",
        "warning",
        "firing",
        3,
    )
    # a replay is answered as the first time, warnings included
    replay = client.post("/v1/runs/ragen-style/batches", json=plain_batch(3))
    assert replay.json()["replayed"] is True
    assert len(replay.json()["warnings"]) == 1


def test_null_rewards_are_accepted_left_out_of_the_reward_figures_and_counted(database_url, client_for):
    client = client_for(database_url)
    client.post("/v1/runs", json={"name": "missing-rewards"})
    with_missing = plain_batch(1, rewards=[1.0, None, 0.0, None, None, None])
    accepted = client.post("/v1/runs/missing-rewards/batches", json=with_missing)
    assert accepted.status_code == 202
    assert accepted.json()["warnings"] == [TWO_PROMPTS]
    results = wait_for(client, accepted.json()["batch_id"])["results"]
    assert results["rewards"]["group_ids"] == [0]  # group 1 has no reward left
    assert results["rewards"]["missing_rewards"] == 4
    assert results["figures"]["missing_reward_ratio"] == pytest.approx(4 / 6)
    assert results["figures"]["reward_mean"] == pytest.approx(0.5)
    assert results["scored"] is True  # cross-scoring does not need rewards

    none_at_all = client.post("/v1/runs/missing-rewards/batches", json=plain_batch(2, rewards=[None] * 6))
    assert none_at_all.json()["warnings"] == [TWO_PROMPTS, "all 6 rewards are missing (null): no reward figures"]
    figures = wait_for(client, none_at_all.json()["batch_id"])["results"]["figures"]
    assert figures["missing_reward_ratio"] == 1.0
    assert "reward_mean" not in figures
