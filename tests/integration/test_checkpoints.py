"""Policy-mode runs score with the checkpoint the trainer announced: full weights or a LoRA adapter."""

from __future__ import annotations

import pytest

from scoring.models import build_tiny_random
from service.jobs.scorers import ScorerPool
from service.jobs.worker import Worker
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


@pytest.mark.parametrize("swapped", ["folder", "config.json"])
def test_a_checkpoint_swapped_for_a_link_out_of_the_root_fails_its_batch_and_is_not_loaded(
    database_url, client_for, tmp_path, swapped
):
    root, outside = tmp_path / "checkpoints", tmp_path / "outside"
    full_checkpoint(root / "step-5")
    full_checkpoint(outside)  # another model's config.json and weights, outside the root
    client = client_for(database_url, scoring_paused=True, checkpoint_root=root)
    client.post("/v1/runs", json={"name": "p", "scorer_mode": "policy", "sampler": {"num_samples": 4}})
    assert client.post("/v1/runs/p/checkpoints", json={"path": "step-5", "step": 5}).status_code == 201
    folder = (root / "step-5").resolve()
    if swapped == "folder":  # after the announcement, the folder becomes a link leading out of the root
        folder.rename(root / "moved")
        folder.symlink_to(outside, target_is_directory=True)
    else:
        (folder / "config.json").unlink()
        (folder / "config.json").symlink_to(outside / "config.json")
    batch_id = client.post("/v1/runs/p/batches", json={"step": 6, "trajectories": trajectories()}).json()["batch_id"]
    state = client.app.state.monitor
    worker = Worker(state.sessions, state.settings, ScorerPool(state.settings))
    try:
        assert worker.run_once()
    finally:
        worker.close()
    status = client.get(f"/v1/batches/{batch_id}").json()
    assert (status["status"], status["attempts"]) == ("failed", 1)
    if swapped == "folder":
        assert status["error"] == (
            f"the full checkpoint {str(folder)!r} now resolves to {str(outside.resolve())!r}, outside the checkpoint "
            f"root {str(root.resolve())!r} (replaced by a link since it was announced); it was not loaded"
        )
    else:
        link = str((outside / "config.json").resolve())
        assert status["error"] == (
            f"the checkpoint {str(folder)!r} holds 'config.json', a link to {link!r} outside the checkpoint root "
            f"{str(root.resolve())!r}"
        )


def test_a_nul_in_a_checkpoints_path_is_refused_naming_the_path_field(database_url, client_for, tmp_path):
    client = client_for(database_url, scoring_paused=True, checkpoint_root=tmp_path)
    client.post("/v1/runs", json={"name": "p", "scorer_mode": "policy"})
    response = client.post("/v1/runs/p/checkpoints", json={"path": "step-5\u0000", "step": 5})
    assert response.status_code == 422
    (error,) = response.json()["detail"]
    assert (error["loc"], error["field"]) == (["body", "path"], "path")
    assert error["msg"] == "Value error, must not contain a NUL character (\\u0000)"
