"""Policy-mode runs score with the checkpoint the trainer announced: full weights or a LoRA adapter."""

from __future__ import annotations

import pytest

from scoring.models import build_tiny_random
from tests.fixtures import trajectories, wait_for

pytestmark = pytest.mark.integration


def lora_adapter(folder):
    from peft import LoraConfig, get_peft_model

    model, _ = build_tiny_random()
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    peft_model.save_pretrained(folder)


def full_checkpoint(folder):
    model, tokenizer = build_tiny_random(seed=1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def mi_of(client, run):
    return client.get(
        f"/v1/runs/{run}/metrics", params={"names": "matched_log_prob_mean", "sampler": "first_turn"}
    ).json()["points"]


@pytest.mark.parametrize(("kind", "make"), [("lora", lora_adapter), ("full", full_checkpoint)])
def test_policy_runs_score_with_the_announced_checkpoint(database_url, client_for, tmp_path, kind, make):
    root = tmp_path / "checkpoints"
    make(root / "step-5")
    client = client_for(database_url, checkpoint_root=root)
    sampler = {"num_samples": 6, "samplers": ["first_turn"], "seed": 3}
    client.post("/v1/runs", json={"name": "policy", "scorer_mode": "policy", "sampler": sampler})
    client.post("/v1/runs", json={"name": "reference", "sampler": sampler})
    body = {"step": 1, "trajectories": trajectories()}
    before = wait_for(client, client.post("/v1/runs/policy/batches", json=body).json()["batch_id"])
    assert before["checkpoint"] is None  # nothing announced yet: the run's scorer
    announced = client.post("/v1/runs/policy/checkpoints", json={"path": "step-5", "kind": kind, "step": 5})
    assert announced.status_code == 201
    after = wait_for(client, client.post("/v1/runs/policy/batches", json=body | {"step": 6}).json()["batch_id"])
    for step in (1, 6):
        reference = wait_for(
            client, client.post("/v1/runs/reference/batches", json=body | {"step": step}).json()["batch_id"]
        )
    assert after["status"] == "done", after
    assert after["checkpoint"] == str((root / "step-5").resolve())
    policy = {p["step"]: p for p in mi_of(client, "policy")}
    baseline = {p["step"]: p for p in mi_of(client, "reference")}
    assert policy[6]["checkpoint"] == after["checkpoint"]
    # Same rows (same seed and step): equal before the checkpoint, different with it.
    assert policy[1]["value"] == pytest.approx(baseline[1]["value"], abs=1e-9)
    assert policy[6]["value"] != pytest.approx(baseline[6]["value"], abs=1e-3)
    assert reference["checkpoint"] is None


def test_a_nul_in_a_checkpoints_path_is_refused_naming_the_path_field(database_url, client_for, tmp_path):
    client = client_for(database_url, scoring_paused=True, checkpoint_root=tmp_path)
    client.post("/v1/runs", json={"name": "p", "scorer_mode": "policy"})
    response = client.post("/v1/runs/p/checkpoints", json={"path": "step-5\u0000", "step": 5})
    assert response.status_code == 422
    (error,) = response.json()["detail"]
    assert (error["loc"], error["field"]) == (["body", "path"], "path")
    assert error["msg"] == "Value error, must not contain a NUL character (\\u0000)"
